"""ModelSpecs built from FLOPs/parameter formulas (no torch): for planner benchmarks and tests."""

from __future__ import annotations

from felactl.spec import Layer, ModelSpec


def transformer_spec(
    num_layers: int = 48, width: int = 2048, seq_len: int = 1024, vocab: int = 50_000, heads: int | None = None
) -> ModelSpec:
    """An embedding, ``num_layers - 2`` transformer blocks and an LM head (GPT-like), fp32. With
    ``heads``, each block records what autograd keeps of a GPT block without recomputation
    (2 x (34 s h + 5 a s^2) bytes per sample); without, the planner estimates it."""
    block_params = 12 * width * width
    act = seq_len * width * 4
    block_flops = 2 * block_params * seq_len + 4 * seq_len * seq_len * width
    saved = None if heads is None else 2 * (34 * seq_len * width + 5 * heads * seq_len * seq_len)
    layers = [
        Layer(
            name="embed",
            params=vocab * width,
            param_bytes=4 * vocab * width,
            activation_bytes_per_sample=act,
            fwd_flops_per_sample=seq_len * width,
            bwd_flops_per_sample=seq_len * width,
            kind="Embedding",
        )
    ]
    layers += [
        Layer(
            name=f"block{i}",
            params=block_params,
            param_bytes=4 * block_params,
            activation_bytes_per_sample=act,
            saved_bytes_per_sample=saved,
            fwd_flops_per_sample=block_flops,
            bwd_flops_per_sample=2 * block_flops,
            kind="Block",
        )
        for i in range(num_layers - 2)
    ]
    head = vocab * width
    layers.append(
        Layer(
            name="head",
            params=head,
            param_bytes=4 * head,
            activation_bytes_per_sample=seq_len * vocab * 4,
            fwd_flops_per_sample=2 * head * seq_len,
            bwd_flops_per_sample=4 * head * seq_len,
            kind="Linear",
        )
    )
    return ModelSpec(
        name=f"transformer-{num_layers}", source="synthetic", input_bytes_per_sample=seq_len * 8, layers=tuple(layers)
    )


def vgg_spec(image: int = 224, width: int = 64, fc_width: int = 4096, classes: int = 1000) -> ModelSpec:
    """VGG-16-like: 13 convs in 5 pooled blocks, then 3 fully connected layers, fp32."""
    layers, c_in, size = [], 3, image
    plan = [(width, 2), (2 * width, 2), (4 * width, 3), (8 * width, 3), (8 * width, 3)]
    for block, (c_out, repeats) in enumerate(plan):
        for r in range(repeats):
            params = 9 * c_in * c_out + c_out
            flops = 2 * 9 * c_in * c_out * size * size
            out = size // 2 if r == repeats - 1 else size
            layers.append(
                Layer(
                    name=f"conv{block}_{r}",
                    params=params,
                    param_bytes=4 * params,
                    activation_bytes_per_sample=4 * c_out * out * out,
                    fwd_flops_per_sample=flops,
                    bwd_flops_per_sample=2 * flops,
                    kind="Conv2d",
                )
            )
            c_in, size = c_out, out
    dims = [c_in * size * size, fc_width, fc_width, classes]
    for i, (a, b) in enumerate(zip(dims, dims[1:])):
        layers.append(
            Layer(
                name=f"fc{i}",
                params=a * b + b,
                param_bytes=4 * (a * b + b),
                activation_bytes_per_sample=4 * b,
                fwd_flops_per_sample=2 * a * b,
                bwd_flops_per_sample=4 * a * b,
                kind="Linear",
            )
        )
    return ModelSpec(
        name="vgg16-like", source="synthetic", input_bytes_per_sample=4 * 3 * image * image, layers=tuple(layers)
    )
