"""Model factories for `torchspan plan` / `torchspan verify` examples.

torchspan plan examples/models.py:mlp --input-shape 64,1024 --devices "a100-40gb,cpu" --memory cuda:0=200MiB
"""

from torch import nn


def mlp() -> nn.Sequential:
    """Eight 1024-wide Linear+ReLU blocks and a 10-way head (about 34 MB of float32 parameters)."""
    layers: list[nn.Module] = []
    for _ in range(8):
        layers += [nn.Linear(1024, 1024), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(1024, 10))


def llama_7b():  # type: ignore[no-untyped-def]
    """A Llama-2-7B-shaped transformers decoder (6.7e9 parameters, 27 GB in float32), randomly initialised:
    plan it for described devices, where `torchspan plan` builds it on the meta device (no memory, no
    initialisation compute).

        torchspan plan examples/models.py:llama_7b --input input_ids=8,2048:int64 --vocab 32000 --nodes 2
        --devices "h100-80gb*8"
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        max_position_embeddings=4096,
        use_cache=False,
    )
    return LlamaForCausalLM(config)


def llama_70b():  # type: ignore[no-untyped-def]
    """A Llama-2-70B-shaped transformers decoder (6.9e10 parameters: 80 blocks, hidden 8192, MLP 28672, 64
    heads, 8 KV heads) in bfloat16, randomly initialised: plan it for described devices (built on meta).

        torchspan plan examples/models.py:llama_70b --input input_ids=8,2048:int64 --vocab 32000 --nodes 4
        --devices "h100-80gb*8"
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=32000,
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        max_position_embeddings=4096,
        use_cache=False,
    )
    return LlamaForCausalLM(config).to(torch.bfloat16)
