"""What both sides of the fleet need to know of a model, with no torch: which model (`resolve`), its
tokenizer and chat template (`tokenizer`, `chat_template`, `gguf_metadata`), and streaming detokenization
(`detokenizer`). The gateway, the engine and the mocker all use this part; it imports only the shared
language (`dynserve.errors`).
"""
