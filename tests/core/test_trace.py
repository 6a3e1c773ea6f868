"""Tracing: programs print like jaxprs; unsupported operations fail naming the op."""

import pytest
import torch

import fqr
from fqr import ops
from fqr.core import TraceError, spec


def prologue(qkv, positions, cache, qw, kw):
    q, k, v = ops.split_qkv(qkv, 32, 8, 128)
    q = ops.rms_norm(q, qw, eps=1e-6, group_size=128)
    k = ops.rms_norm(k, kw, eps=1e-6, group_size=128)
    return (
        ops.rope(q, positions, cache, head_dim=128),
        ops.rope(k, positions, cache, head_dim=128),
        v,
    )


def test_program_prints_like_a_jaxpr():
    program = fqr.trace(
        prologue,
        spec("T", 6144),
        spec("T", dtype=torch.int64),
        spec(40960, 128, dtype=torch.float32),
        spec(128),
        spec(128),
    )
    text = str(program)
    lines = text.splitlines()
    assert (
        lines[0] == "{ lambda a:bf16[T,6144] b:int64[T] c:fp32[40960,128] d:bf16[128] e:bf16[128]. "
        "let"
    )
    assert lines[1].strip() == (
        "f:bf16[T,4096] g:bf16[T,1024] h:bf16[T,1024] = "
        "split_heads[sections=(32x128@0,8x128@4096,8x128@5120)] a"
    )
    assert (
        lines[2].strip()
        == "i:bf16[T,4096] = rms_norm[count=128 eps=1e-06 group=128 offset=0.0] f d _ _"
    )
    assert lines[4].strip() == "k:bf16[T,4096] = rope[d=128 neox=True round_to=None] i b c"
    assert lines[-1] == "  in (k, l, h) }"
    assert [e.prim.name for e in program.eqns] == [
        "split_heads",
        "rms_norm",
        "rms_norm",
        "rope",
        "rope",
    ]


def test_unfused_numerics_rounds_in_the_norm_and_the_rope():
    p = fqr.get_preset("qwen3-8b")
    from fqr.prologue import program_of

    fused = program_of(p, torch.bfloat16)
    unfused = program_of(p, torch.bfloat16, numerics="unfused")
    assert "round_to" not in "".join(ln for ln in str(fused).splitlines() if "rms_norm" in ln)
    assert "round_to=None" in str(fused)  # rope's
    norms = [ln for ln in str(unfused).splitlines() if "rms_norm[" in ln]
    ropes = [ln for ln in str(unfused).splitlines() if "rope[" in ln]
    assert len(norms) == 2 and all("round_to=bf16" in ln for ln in norms)
    assert len(ropes) == 2 and all("round_to=bf16" in ln for ln in ropes)


@pytest.mark.parametrize(
    "body, op",
    [
        (lambda x: x.view(-1), "Tensor.view"),
        (lambda x: torch.matmul(x, x), "matmul"),
        (lambda x: x * 2, "Tensor.__mul__"),
        (lambda x: torch.nn.functional.silu(x), "silu"),
    ],
)
def test_unsupported_torch_op_is_named(body, op):
    with pytest.raises(TraceError, match=op.replace(".", r"\.")):
        fqr.trace(body, spec("T", 128))


def test_concrete_tensor_inside_trace_is_rejected():
    w = torch.ones(128)
    with pytest.raises(TraceError, match="operand 1 is a concrete Tensor"):
        fqr.trace(lambda x: ops.rms_norm(x, w, eps=1e-6, group_size=128), spec("T", 128))


def test_shape_rules_name_the_argument_while_tracing():
    with pytest.raises(ValueError, match="qkv width 100"):
        fqr.trace(lambda x: ops.split_qkv(x, 2, 1, 32), spec("T", 100))
    with pytest.raises(ValueError, match="weight must have shape"):
        fqr.trace(
            lambda x, w: ops.rms_norm(x, w, eps=1e-6, group_size=64), spec("T", 128), spec(32)
        )
    with pytest.raises(ValueError, match="rotary_dim .* exceeds head_dim"):
        fqr.trace(
            lambda x, p, c: ops.rope(x, p, c, head_dim=64),
            spec("T", 128),
            spec("T", dtype=torch.int64),
            spec(10, 128, dtype=torch.float32),
        )
