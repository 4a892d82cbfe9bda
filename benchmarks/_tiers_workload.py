"""The tiers benchmark's workload and fleets, as pure functions: the conversations, the order their turns are
played in, the device pool sized so that they evict each other, and each policy's `dynctl serve` flags.

The workload is multi-turn chat in which every conversation opens with a long context of its own (a system
message of notes, then a first question) and each later turn appends the previous answer and a new question.
Turns are played one at a time, round robin over the conversations (every conversation's turn 0, then every
turn 1, ...), so between two turns of a conversation every other conversation has taken its turn on the
same two workers. The device pool of each worker holds about one conversation's largest request, so by the
time a conversation comes back its blocks have left the device: a policy without tiers prefills them again,
a tiered one onboards them.

Words are drawn from `WORDS`, each one token with its leading space in SmolLM2's vocabulary (checked when
the list was written), so a text of n words is n tokens; `max_prompt_tokens` bounds a turn's prompt from
that, the chat template's few tokens per message and the longest answer, and the pool is sized from it.
Everything is drawn from one seeded RNG: every policy plays the same script.

The mocker part plays the same script and policies against mocker workers at a GPU profile
(`mocker_flags`): the same device pools in blocks, the tiers in the same blocks, each a profile's block of
KV bytes (`mocker_block_bytes`) on the host and on disk.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

__all__ = [
    "FULL_PLAN",
    "POLICIES",
    "QUICK_PLAN",
    "CONTROLS",
    "Conversation",
    "Plan",
    "Policy",
    "Sizes",
    "WORDS",
    "make_conversations",
    "max_prompt_tokens",
    "mocker_block_bytes",
    "mocker_flags",
    "policies",
    "policy_flags",
    "size_fleet",
    "turn_order",
]

WORDS = (
    "time person year way day thing man world life hand part child eye woman place work week case point "
    "company number group problem fact make know take see come think look want give use find tell ask seem "
    "feel try leave call good new first last long great little own other old right big high different small "
    "large next early young important few public bad same able system model cache router worker request "
    "token prefix block memory latency cluster server queue stream engine batch kernel layer vector policy "
    "metric scale pool river garden window market letter table winter summer music paper water light"
).split()
_MESSAGE_OVERHEAD_TOKENS = 8  # ChatML: `<|im_start|>role\n ... <|im_end|>\n` is 5; a little slack
_HEADER_TOKENS = 16  # a message's own opening words ("Notes of project 7:", "Question 3:"): digits split
_ANSWER_SLACK_TOKENS = 8  # an answer re-encoded in the next prompt may take a few tokens more than it had


@dataclass(frozen=True, slots=True)
class Plan:
    """A run's size: `num_conversations` conversations of `num_turns` turns; each opens with notes of
    `context_words` words, asks questions of `user_words` (low, high) words and gets answers of at most
    `max_tokens` tokens (greedy)."""

    num_conversations: int
    num_turns: int
    context_words: int
    user_words: tuple[int, int]
    max_tokens: int
    block_size: int = 16


QUICK_PLAN = Plan(num_conversations=6, num_turns=3, context_words=400, user_words=(30, 50), max_tokens=16)
FULL_PLAN = Plan(num_conversations=8, num_turns=5, context_words=1000, user_words=(40, 80), max_tokens=24)


@dataclass(frozen=True, slots=True)
class Conversation:
    system: str
    questions: tuple[str, ...]  # one per turn


def _words(rng: random.Random, num_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(num_words))


def make_conversations(plan: Plan, seed: int) -> tuple[Conversation, ...]:
    """The script every policy plays: a function of `plan` and `seed` alone."""
    rng = random.Random(seed)
    conversations = []
    for index in range(plan.num_conversations):
        notes = _words(rng, plan.context_words)
        system = f"You answer questions about the notes of project {index}. Notes: {notes}"
        questions = tuple(f"Question {turn + 1}: what about {_words(rng, rng.randint(*plan.user_words))}?"
                          for turn in range(plan.num_turns))
        conversations.append(Conversation(system, questions))
    return tuple(conversations)


def turn_order(num_conversations: int, num_turns: int) -> list[tuple[int, int]]:
    """(conversation, turn) in the order they are played: every conversation's turn 0, then every turn 1,
    and so on."""
    return [(conversation, turn) for turn in range(num_turns) for conversation in range(num_conversations)]


def max_prompt_tokens(conversation: Conversation, turn: int, max_tokens: int) -> int:
    """An upper bound of turn `turn`'s prompt tokens (`WORDS` are one token each: the module docstring)."""
    texts = [conversation.system, *conversation.questions[:turn + 1]]
    bound = sum(len(text.split()) + _HEADER_TOKENS + _MESSAGE_OVERHEAD_TOKENS for text in texts)
    bound += turn * (max_tokens + _ANSWER_SLACK_TOKENS + _MESSAGE_OVERHEAD_TOKENS)
    return bound + _MESSAGE_OVERHEAD_TOKENS  # the generation prompt


@dataclass(frozen=True, slots=True)
class Sizes:
    """Blocks per worker: the device pool (room for the largest request and a little more), and the whole
    workload's KV at the end of the run (every conversation's last request), the working set of the tiers."""

    device_blocks: int
    workload_blocks: int


def size_fleet(plan: Plan, conversations: tuple[Conversation, ...]) -> Sizes:
    block = plan.block_size
    last_turn = plan.num_turns - 1
    last = [max_prompt_tokens(c, last_turn, plan.max_tokens) + plan.max_tokens for c in conversations]
    return Sizes(device_blocks=math.ceil(max(last) / block) + 2,
                 workload_blocks=sum(math.ceil(tokens / block) for tokens in last))


@dataclass(frozen=True, slots=True)
class Policy:
    """What a fleet keeps below the device pool, in blocks per worker (0: that tier off), and whether its
    router credits lower-tier hits (False: host and disk hit weights 0, a router blind to the tiers);
    `device_blocks` replaces the small device pool (None: keep it); `peer_pulls`: workers pull a prefix
    their peer holds (`--kv-peer-pulls`)."""

    name: str
    host_blocks: int
    disk_blocks: int
    tier_aware_router: bool
    device_blocks: int | None = None
    peer_pulls: bool = False


POLICIES = ("none", "host", "host_disk", "all")  # the four, run by default
CONTROLS = ("device",)  # run when asked: a device pool that holds the whole workload, no tiers


def policies(sizes: Sizes, *, peer_pulls: bool = False) -> dict[str, Policy]:
    """The four policies at these sizes. `host` keeps the whole workload on the host tier; `host_disk` and
    `all` keep half a device pool there and the rest on disk (with room to spare); only `all`'s router sees
    the tiers, and with `peer_pulls` (the settings have `kv_peer_pulls`) `all` pulls from peers too: the
    issue's "host + disk + peer pulls with tier-aware routing". Without, `all` runs without the pulls.
    The control `device` has no tiers but a device pool that holds the whole workload: every returning turn
    is a device prefix hit, the best a tier can approach, and its answers show what reusing a prefix's KV
    does to greedy outputs without any tier involved."""
    host_all = math.ceil(1.25 * sizes.workload_blocks)
    host_small = max(1, sizes.device_blocks // 2)
    return {"none": Policy("none", 0, 0, tier_aware_router=False),
            "host": Policy("host", host_all, 0, tier_aware_router=False),
            "host_disk": Policy("host_disk", host_small, host_all, tier_aware_router=False),
            "all": Policy("all", host_small, host_all, tier_aware_router=True, peer_pulls=peer_pulls),
            "device": Policy("device", 0, 0, tier_aware_router=False, device_blocks=sizes.workload_blocks)}


def policy_flags(policy: Policy, sizes: Sizes, *, page_bytes: int, disk_file_bytes: int,
                 disk_dir: str | None) -> list[str]:
    """`dynctl serve` flags for `policy`: two aggregated workers behind the kv router, the device pool of
    `sizes`, and the tiers in bytes (`page_bytes` a block's KV in memory, `disk_file_bytes` its file; the
    disk tier under `disk_dir`, None: the workers' default)."""
    device_blocks = policy.device_blocks or sizes.device_blocks
    flags = ["--workers", "2", "--router", "kv", "--kv-blocks", str(device_blocks)]
    if policy.host_blocks:
        flags += ["--kv-host-bytes", str(policy.host_blocks * page_bytes)]
    if policy.disk_blocks:
        flags += ["--kv-disk-bytes", str(policy.disk_blocks * disk_file_bytes)]
        flags += ["--kv-disk-dir", disk_dir] if disk_dir is not None else []
    if policy.peer_pulls:
        flags += ["--kv-peer-pulls"]
    if not policy.tier_aware_router:
        flags += ["--router-host-hit-weight", "0", "--router-disk-hit-weight", "0"]
    return flags


def mocker_block_bytes(kv_bytes_per_token: int, block_size: int) -> int:
    """A mocker's block of KV at a profile: what it counts a block as on the host and on disk (the mocker
    sizes its tiers by `--kv-host-bytes` and `--kv-disk-bytes` over this)."""
    return kv_bytes_per_token * block_size


def mocker_flags(profile: str, speedup: float) -> list[str]:
    """What makes a policy's fleet a mocker fleet at `profile` (pseudo-random answers, the profile's step and
    onboarding times divided by `speedup`)."""
    return ["--mocker", profile, "--mocker-speedup", f"{speedup:g}"]
