"""greedy_tokens (model/sampling.py) is the argmax every decode path picks with; it runs through
numpy on CPU for speed, so it must agree with torch.argmax to the index: ties, NaN, bf16."""

import pytest
import torch

from codecomplete.model.sampling import greedy_tokens


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(50,), (3, 50), (2, 5, 50)])
def test_greedy_tokens_is_torch_argmax(dtype, shape):
    g = torch.Generator().manual_seed(sum(shape))
    x = torch.randint(-3, 4, shape, generator=g).to(dtype)  # small integers: many ties
    flat = x.view(-1, shape[-1])
    flat[0, 7] = float("nan")  # NaN wins, as in torch
    flat[-1, 3] = float("inf")
    got = greedy_tokens(x)
    assert got == x.argmax(-1).tolist()
    assert isinstance(greedy_tokens(x.view(-1, shape[-1])[0]), int)
