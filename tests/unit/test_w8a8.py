"""model.quantization=w8a8: int8 weights times activations quantized to 8 bits per row as
they come. The C++ row quantization and rescale against the same math in torch ops; the
matmul against float64 math on the same integers, eager (C++ or torch ops) and compiled;
SmoothQuant's rescaling against the model it rescaled (the function must not change); the
whole model against the unquantized one; and the config and calibration around it."""

from __future__ import annotations

import pytest
import torch

from meshserve.comm.groups import AxisGroup
from meshserve.configs import ConfigError, load_config
from meshserve.configs.cpu_features import cpu_features, parse_cpuinfo
from meshserve.configs.model_info import read_model_info
from meshserve.configs.validate import check_config, quantization_problems
from meshserve.engine.calibration import calibration_ids
from meshserve.layers.attention import build_attention_metadata
from meshserve.layers.kernels import cpu_library
from meshserve.layers.llama import LlamaForCausalLM
from meshserve.layers.loader import load_weights
from meshserve.layers.quant import U8_ZERO, W8A8Matmul, amx_int8_runs, quantize_int8, quantize_rows_u8
from meshserve.layers.smoothquant import smooth
from support.cpu import needs_vnni
from support.reference import meshserve_logits

PROMPTS = [[1, 504, 3575, 282, 4649, 314], list(range(300, 341)), [5, 6, 7]]
native = pytest.mark.skipif(cpu_library.load() is None, reason="no C++ compiler for the CPU kernels")


def rows_with_outliers(rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
    x = torch.randn(rows, cols) * torch.rand(rows, 1) * 3
    x[:, 3] *= 40  # an outlier channel, as LLM activations have
    if rows > 1:
        x[1] = 0  # an all-zero row
    return x.to(dtype)


@native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,cols", [(1, 7), (37, 100), (64, 1536)])
def test_native_row_quantization_matches_torch_ops(dtype, rows, cols, cpu_build):
    torch.manual_seed(0)
    wide = rows_with_outliers(rows, cols + 5, dtype)
    x = wide[:, :cols]  # rows with a stride wider than they are
    codes, scales = cpu_build.ops.quantize_rows_u8(x)
    want_codes, want_scales = quantize_rows_u8(x)
    assert codes.dtype == torch.uint8 and scales.dtype == torch.float32 and scales.shape == (rows, 1)
    torch.testing.assert_close(scales, want_scales, rtol=1e-6, atol=0)
    # x * (1 / scale) against x / scale: a tie may round the other way, never further
    assert (codes.int() - want_codes.int()).abs().max() <= 1
    assert (codes.int() != want_codes.int()).float().mean() < 1e-3
    assert codes.min() >= 1 and codes.max() <= 255
    back = (codes.float() - U8_ZERO) * scales
    assert ((back - x.float()).abs() <= scales * 0.5 + scales * 1e-3).all()
    if rows > 1:
        assert (codes[1] == U8_ZERO).all()


@native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_native_row_rescale_matches_torch_ops(dtype, cpu_build):
    torch.manual_seed(0)
    y = torch.randn(70, 3000).to(dtype)
    scales = torch.rand(70, 1) * 4
    want = (y.float() * scales).to(dtype)
    got = cpu_build.ops.scale_rows_(y, scales)
    assert got.data_ptr() == y.data_ptr()
    assert torch.equal(y, want)  # one product and one rounding per element: no reduction
    with pytest.raises(RuntimeError, match="one float32 scale per row: 70 rows, 69 scales"):
        cpu_build.ops.scale_rows_(y, scales[:69])


def _paths(w: torch.Tensor) -> dict[str, W8A8Matmul]:
    """Every way this machine multiplies: torch ops around oneDNN, the C++ op around it, and
    where the CPU has AMX-INT8 the AMX product."""
    paths = {"torch ops": W8A8Matmul(w, None)}
    library = cpu_library.load()
    if library is not None:
        paths["C++"] = W8A8Matmul(w, library, amx=False)
        if amx_int8_runs(library):
            paths["AMX"] = W8A8Matmul(w, library)
            assert paths["AMX"].amx is not None
    return paths


@needs_vnni
@pytest.mark.parametrize("rows", [1, 3, 32, 100])
def test_w8a8_matmul_matches_the_math_on_quantized_inputs(rows):
    """Against float64 math on the same integers and scales (the output's rounding apart),
    on every path; and within 8% of the unquantized product (an outlier channel 40x the
    others leaves them few levels: what smoothing is for)."""
    torch.manual_seed(0)
    w = torch.randn(384, 576) * 0.05
    x = rows_with_outliers(rows, 576, torch.bfloat16)
    codes, scale = quantize_int8(w)
    x_codes, x_scale = quantize_rows_u8(x)
    want = ((x_codes.double() - U8_ZERO) * x_scale.double()) @ (codes.double() * scale.double()[:, None]).t()
    exact = x.double() @ w.double().t()
    for name, matmul in _paths(w).items():
        got = matmul(x.view(rows, 1, 576)).view(rows, 384)
        assert got.dtype == torch.bfloat16, name
        torch.testing.assert_close(got.double(), want, atol=2e-2, rtol=1e-2, msg=name)
        assert (got.double() - exact).norm() / exact.norm() < 8e-2, name


@needs_vnni
def test_w8a8_matmul_compiled_matches_eager():
    torch.manual_seed(0)
    w = torch.randn(256, 192) * 0.05
    matmul = W8A8Matmul(w, cpu_library.load())
    compiled = torch.compile(lambda x: matmul(x) + 1, dynamic=True, fullgraph=True)
    for rows in (2, 9, 33):
        x = rows_with_outliers(rows, 192, torch.float32)
        torch.testing.assert_close(compiled(x), matmul(x) + 1, atol=1e-4, rtol=1e-4)
    assert (matmul.amx is not None) == amx_int8_runs(cpu_library.load())  # whichever this machine takes


def _plain_model(path):
    """A tiny model with its weights as loaded (nothing packed or quantized), float32."""
    info = read_model_info(str(path))
    model = LlamaForCausalLM(info, AxisGroup.single("tp"), torch.float32, max_position=512)
    load_weights(model, info)
    return model.eval()


def _logits(model, ids: list[int]) -> torch.Tensor:
    n, block = len(ids), 8
    blocks = -(-n // block)
    attn = model.model.layers[0].self_attn
    shape = (blocks, block, attn.local_num_kv_heads, attn.head_dim)
    caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in model.model.layers]
    meta = build_attention_metadata([n], [n], [list(range(blocks))], block)
    with torch.inference_mode():
        hidden, _ = model(torch.tensor(ids), torch.arange(n), caches, meta)
        return model.compute_logits(hidden)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_smoothing_moves_range_without_changing_the_model(tiny_checkpoints, kind):
    model = _plain_model(tiny_checkpoints[kind])
    before = [_logits(model, p) for p in PROMPTS]
    layer = model.model.layers[0]
    norm, down = layer.input_layernorm.weight.clone(), layer.mlp.down_proj.weight.clone()
    smooth(model, list(range(100, 260)), AxisGroup.single("tp"))
    assert not torch.allclose(layer.input_layernorm.weight, norm)
    assert not torch.allclose(layer.mlp.down_proj.weight, down)
    for got, want in zip((_logits(model, p) for p in PROMPTS), before):
        torch.testing.assert_close(got, want, atol=1e-4 * want.abs().max().item(), rtol=1e-4)


class FakeW8A8:
    """The w8a8 multiply in float64 on the same integers: the oracle for the whole model."""

    def __init__(self, weight: torch.Tensor):
        codes, scale = quantize_int8(weight)
        self.weight = codes.double() * scale.double()[:, None]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        codes, scale = quantize_rows_u8(rows)
        y = ((codes.double() - U8_ZERO) * scale.double()) @ self.weight.t()
        return y.to(x.dtype).view(*x.shape[:-1], -1)


@needs_vnni
def test_w8a8_model_matches_the_same_math_in_float(tiny_checkpoints):
    """build_model's w8a8 (smoothing, then every linear and the head on 8-bit inputs)
    against the unpacked model smoothed on the same ids with every multiply done in
    float64 on the same integers: a small share of the quantization's own error (the
    activations' codes are rounded from floats that differ in the last bits)."""
    path = tiny_checkpoints["llama-untied"]
    calibration = list(range(100, 400))
    got = meshserve_logits(path, PROMPTS, quantization="w8a8", calibration=calibration)
    oracle = _plain_model(path)
    plain = [_logits(oracle, p) for p in PROMPTS]
    smooth(oracle, calibration, AxisGroup.single("tp"))
    for module in oracle.modules():
        if hasattr(module, "pack_weight"):
            module.packed = FakeW8A8(module.weight)
    for g, p, prompt in zip(got, plain, PROMPTS):
        want = _logits(oracle, prompt)
        quantization = (g - p).norm() / p.norm()
        assert quantization > 1e-2  # quantization did happen
        # The same math up to an 8-bit code that float rounding (~1e-7 apart) moved across a
        # rounding boundary: on an Ice Lake Xeon one such code moved the 41-token prompt's logits
        # by 0.9% (the others within 1e-7), against 5% for the quantization itself.
        assert (g - want).norm() / want.norm() < quantization / 4
        assert (g.argmax(-1) == want.argmax(-1)).float().mean() >= 0.9
    with pytest.raises(ValueError, match="pass calibration token ids"):
        meshserve_logits(path, PROMPTS, quantization="w8a8")


@needs_vnni
def test_w8a8_config_errors_and_calibration(tiny_checkpoints):
    path = str(tiny_checkpoints["llama"])
    for name in ("parallel.pipeline", "parallel.context"):
        with pytest.raises(ConfigError, match=rf"w8a8 calibrates on one forward of the whole model on each rank, "
                                              rf"but {name} = 2; use {name}=1"):
            check_config(load_config(None, [f"model.path={path}", "model.quantization=w8a8", f"{name}=2"]))
    config = load_config(None, [f"model.path={path}", "model.quantization=w8a8", "parallel.tensor=2"])
    info = check_config(config)
    ids = calibration_ids(config, info)
    assert len(ids) > 300 and all(0 <= i < info.vocab_size for i in ids)
    assert calibration_ids(load_config(None, [f"model.path={path}", "model.quantization=int8"]), info) is None


AVX2_ONLY = parse_cpuinfo("flags\t\t: fpu sse sse2 avx fma f16c avx2\n")
AVX512_VNNI = parse_cpuinfo("flags\t\t: sse2 avx2 fma f16c avx512f avx512bw avx512vl avx512dq avx512_vnni\n")


def test_w8a8_is_refused_without_vnni(tiny_checkpoints):
    """On a CPU without VNNI oneDNN's u8 x s8 product saturates its 16-bit pair sums (and
    crawls): refused before any rank starts, naming the feature, and by the layer itself."""
    config = load_config(None, [f"model.path={tiny_checkpoints['llama']}", "model.quantization=w8a8"])
    info = read_model_info(str(tiny_checkpoints["llama"]))
    problems = quantization_problems(config, info, AVX2_ONLY)
    assert len(problems) == 1 and "needs VNNI" in problems[0] and "no VNNI" in problems[0]
    assert "model.quantization=int8" in problems[0]
    assert quantization_problems(config, info, AVX512_VNNI) == []
    if not cpu_features().vnni:
        with pytest.raises(ConfigError, match="needs VNNI"):
            check_config(config)
        with pytest.raises(ValueError, match="w8a8 needs a CPU with VNNI"):
            W8A8Matmul(torch.randn(32, 64), None)
