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


def _bf16_cases():
    g = torch.Generator().manual_seed(5)
    for n in (1, 31, 32, 33, 95, 4099, 49152):
        x = torch.randn(3, n, generator=g).to(torch.bfloat16)
        yield x
        yield torch.round(x * 2) / 2  # ties, the first wins
        yield torch.where(x < 0.5, torch.tensor(float("-inf")), x).to(torch.bfloat16)  # the greedy head's -inf
        yield torch.full((2, n), float("-inf"), dtype=torch.bfloat16)
        signed = torch.where(torch.rand(2, n, generator=g) < 0.5, torch.tensor(0.0), torch.tensor(-0.0))
        yield signed.to(torch.bfloat16)  # -0 and +0 tie
        neg = -x.abs()
        neg.view(torch.int16)[:, -1] = -32768  # -0, the largest here, last
        yield neg
        nan = x.clone()
        nan.view(torch.int16)[0, n // 2] = -64  # a negative NaN (0xffc0): still the largest, as in torch
        nan[1, n - 1] = float("nan")
        nan[1, n // 3] = float("nan")  # the first NaN wins
        yield nan
    x = torch.randn(40, 64, generator=g).to(torch.bfloat16)
    yield x.t()  # not contiguous
    yield x[::3, 5:]


@pytest.mark.parametrize("case", list(range(51)))
def test_native_bf16_argmax_is_torch_argmax(case):
    """CPU bf16 logits take native.argmax_bf16 (no fp32 copy): every edge of torch.argmax's order."""
    from codecomplete.model import native

    if not native.available():
        pytest.skip("no native kernels")
    x = list(_bf16_cases())[case]
    assert greedy_tokens(x) == x.float().argmax(-1).tolist()
    assert native.argmax_bf16(x) == x.float().argmax(-1).tolist()
