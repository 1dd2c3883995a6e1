"""Llama policy model, its configuration presets, Hugging Face checkpoint I/O and tokenizers.

    from llamarl.models import Llama, LlamaConfig, LLAMA_CONFIGS, CharTokenizer, load_tokenizer
    model = Llama(LLAMA_CONFIGS["tiny"])                     # random init, HF parameter names
    model = Llama.from_pretrained(path, dtype=torch.bfloat16) # local HF directory
    model.save_pretrained(path)                               # loadable by transformers
    rm = load_reward_model(path)                              # a LlamaForSequenceClassification, num_labels=1
    rm.scores(input_ids, lengths)                             # fp32 rewards [B] of a right-padded batch
"""

from llamarl.models.config import LLAMA_CONFIGS, LlamaConfig
from llamarl.models.llama import Llama
from llamarl.models.reward_model import LlamaRewardModel, check_reward_model, load_reward_model
from llamarl.models.tokenizer import CharTokenizer, HFTokenizer, load_tokenizer

__all__ = [
    "LLAMA_CONFIGS", "CharTokenizer", "HFTokenizer", "Llama", "LlamaConfig", "LlamaRewardModel", "check_reward_model",
    "load_reward_model", "load_tokenizer",
]
