"""bench/q8_k_accuracy.py's simulation rounds a linear's input as the ARM quantizer does: by
super-blocks (Q8_K) and by blocks (Q8_0), against compiler/kernels/act_quant.py's kernel on the
same row (the perplexity run itself is the bench, not a test)."""

from __future__ import annotations

import numpy as np
import pytest

from qwc.bench import q8_k_accuracy


@pytest.mark.parametrize("super_blocks", [True, False])
def test_the_simulation_rounds_as_the_arm_quantizer(super_blocks):
    import torch
    import tvm

    from qwc.compiler.kernels import act_quant
    from qwc.compiler.targets import get_target

    k = 1536
    x = (np.random.default_rng(3).standard_normal((1, k)) * np.linspace(0.1, 4, k)).astype(np.float32)
    f = act_quant.fused_quantizer(k, -8, True, layout="arm", super_blocks=super_blocks)
    lib = tvm.compile(tvm.IRModule({"main": f.with_attr("global_symbol", "main")}),
                      target=get_target("host").tvm_target())
    nb = k // 32
    outs = [tvm.runtime.tensor(np.zeros(s, d)) for s, d in
            (((1, nb, 32), np.int8), ((1, nb), np.float32), ((1, nb), np.int32))]
    lib(tvm.runtime.tensor(x), *outs)
    aq, ad = outs[0].numpy(), outs[1].numpy()
    codes = np.concatenate([aq[..., :16, None], aq[..., 16:, None]], -1).reshape(1, k)   # de-interleaved
    kernel = codes * np.repeat(ad, 32, axis=1)
    width = q8_k_accuracy.SUPER if super_blocks else q8_k_accuracy.BLOCK
    sim = q8_k_accuracy.fake_quant(torch.from_numpy(x), width).numpy()
    np.testing.assert_allclose(sim, kernel, rtol=1e-6, atol=1e-7)
    assert len(np.unique(ad)) == k // width   # one scale a super-block (or block), at each block's place


def test_a_partial_last_group_takes_its_own_scale():
    """K = 34 by blocks: the last two values share their own amax / 127, not the first block's."""
    import torch

    x = torch.tensor([[4.0] * 32 + [0.5, -0.3]])
    out = q8_k_accuracy.fake_quant(x, 32)
    assert torch.equal(out[0, :33], x[0, :33])   # each group's amax is its code 127
    d = 0.5 / 127
    assert torch.isclose(out[0, 33], torch.tensor(-76 * d), rtol=1e-6)   # -0.3 / d = -76.2
