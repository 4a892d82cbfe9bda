"""The planner: scales the prefill and decode pools against TTFT and ITL targets. A pure decision core
(`core.py`), predictors of the coming load, capacity profiles (`profile.py`: what one worker sustains,
measured by `dynctl profile`), and thin connectors to the pools and Prometheus."""
