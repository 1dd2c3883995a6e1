"""llamarl: asynchronous, distributed reinforcement learning for LLMs after the LlamaRL design.

A single controller drives generator, trainer and reward executors that run in parallel; the trainer
pushes new weights straight into generator memory (DDMA weight sync); AIPO corrects for the generator
sampling with a policy that lags the trainer by a bounded number of versions.

Subpackages: models (Llama + HF I/O), generation (KV-cache engine), algorithms (advantages, AIPO),
rewards, data, weight_sync (layouts, planner, transports over llamarl._C), runtime (processes,
channels), executors, controller, train, eval.
"""

__version__ = "0.1.0"
