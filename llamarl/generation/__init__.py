"""Batched generation with a preallocated KV cache (see engine.py for the algorithm and the log-prob convention).

    from llamarl.generation import generate, SamplingParams, GenerationOutput, GenerationEngine
    outs = generate(model, prompts, SamplingParams(max_new_tokens=16, temperature=0.0))
    engine = GenerationEngine(model, max_batch_size=64, max_seq_len=1024)   # reused across calls
    outs = engine.generate(prompts, SamplingParams(temperature=1.0, n=8, seed=0), eos_token_id=tok.eos_id)
    outs = engine.generate(prompts, SamplingParams(stop=["\\nQuestion:"]), decode=tok.decode)  # stop strings
"""

from llamarl.generation.engine import GenerationEngine, GenerationOutput, generate
from llamarl.generation.kv_cache import KVCache
from llamarl.generation.sampling import SamplingParams, sample_tokens

__all__ = ["GenerationEngine", "GenerationOutput", "KVCache", "SamplingParams", "generate", "sample_tokens"]
