"""Models as onnxruntime-genai's model builder writes them, from Hugging Face folders with
random weights: the builder's own export, where its Python package, torch and transformers
are installed (the tests that use it skip otherwise, saying which is missing)."""
import importlib
import os
import subprocess
import sys
from typing import Optional


def builder_missing() -> Optional[str]:
    """None where the builder can run, else what it lacks."""
    for name in ("torch", "transformers", "safetensors", "onnxruntime_genai.models.builder"):
        try:
            importlib.import_module(name)
        except Exception as e:  # an import error, or a native library that fails to load
            return f"the model builder needs {name} ({type(e).__name__}: {e})"
    return None


def gpt_oss_folder(out: str, hidden: int = 512, experts: int = 8, top_k: int = 2, layers: int = 4,
                   vocab: int = 2048, window: int = 128, seed: int = 0) -> str:
    """A gpt-oss checkpoint folder with random weights: transformers' GptOss in bf16, the
    experts also as the original checkpoint's MXFP4 blocks and E8M0 scales (which the
    builder's int4 QMoE export reads), and a word-level tokenizer."""
    import torch
    import transformers
    from safetensors.torch import load_file, save_file

    cfg = transformers.GptOssConfig(hidden_size=hidden, intermediate_size=hidden, num_hidden_layers=layers,
                                    num_attention_heads=hidden // 64, num_key_value_heads=2, head_dim=64,
                                    num_local_experts=experts, num_experts_per_tok=top_k, vocab_size=vocab,
                                    max_position_embeddings=4096, sliding_window=window)
    torch.manual_seed(seed)
    model = transformers.GptOssForCausalLM(cfg).to(torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    model.save_pretrained(out)
    path = os.path.join(out, "model.safetensors")
    tensors = load_file(path)
    g = torch.Generator().manual_seed(seed + 1)
    for i in range(layers):
        # blocks [experts, out, in / 32, 16]: two e2m1 values a byte; scales [experts, out, in / 32]:
        # powers of two, 2^(s - 127), here about 1/256
        for name, n, k in (("gate_up_proj", 2 * hidden, hidden), ("down_proj", hidden, hidden)):
            prefix = f"model.layers.{i}.mlp.experts.{name}"
            tensors[prefix + "_blocks"] = torch.randint(0, 256, (experts, n, k // 32, 16), generator=g,
                                                        dtype=torch.uint8)
            tensors[prefix + "_scales"] = torch.randint(119, 122, (experts, n, k // 32), generator=g,
                                                        dtype=torch.uint8)
    save_file(tensors, path, metadata={"format": "pt"})
    _word_tokenizer(out, vocab)
    return out


def _word_tokenizer(out: str, vocab: int) -> None:
    """A word-level tokenizer of `vocab` words t0, t1, ... saved into `out`."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", eos_token="t1",
                                         bos_token="t2").save_pretrained(out)


def phi3_longrope_folder(out: str, hidden: int = 256, heads: int = 4, layers: int = 2, vocab: int = 2048,
                         original: int = 32, longest: int = 128, seed: int = 0) -> str:
    """A Phi-3.5-mini-shaped checkpoint folder with random weights: transformers' Phi3 with
    LongRoPE (short factors up to `original` positions, long ones past it, up to
    `longest`), and a word-level tokenizer. The builder exports its rotary tables as two
    pairs and an If on the attention mask's length."""
    import torch
    import transformers

    half = hidden // heads // 2
    cfg = transformers.Phi3Config(
        hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=heads, vocab_size=vocab, max_position_embeddings=longest,
        original_max_position_embeddings=original, bos_token_id=2, eos_token_id=1, pad_token_id=0,
        rope_scaling={"type": "longrope", "short_factor": [1.0 + 0.05 * i for i in range(half)],
                      "long_factor": [1.0 + 0.5 * i for i in range(half)]})
    torch.manual_seed(seed)
    model = transformers.Phi3ForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    model.save_pretrained(out)
    _word_tokenizer(out, vocab)
    return out


def build(hf_folder: str, out: str, precision: str = "int4", ep: str = "cuda") -> str:
    """The builder's export of `hf_folder` into `out` (model.onnx, its data, genai_config.json)."""
    proc = subprocess.run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", hf_folder, "-o", out,
                           "-p", precision, "-e", ep, "-c", os.path.join(out, "cache")],
                          capture_output=True, text=True, timeout=600)
    if proc.returncode:
        raise RuntimeError(f"the builder failed:\n{proc.stderr[-3000:]}")
    return out
