"""ember bench quant: the bars judged from the rows, and the rendered table."""

from ember.bench.commands.quant import Row, bars, report, variants


def _rows(awq_ppl=10.5, rtn_ppl=11.0, fp8_ppl=10.1):
    return [
        Row("dense", "bfloat16 dense", None, 270_000_000, [40.0, 41.0, 39.0], 10.0, 1000),
        Row("int8", "int8 copy", None, 405_000_000, [70.0, 70.0, 70.0], None, 0),
        Row("gguf", "GGUF Q4_1 packed", None, 101_000_000, [80.0, 82.0, 81.0], 10.05, 1000),
        Row("awq", "AWQ int4 g32", 32, 100_000_000, [80.0, 80.0, 80.0], awq_ppl, 1000),
        Row("rtn", "RTN int4 g32", 32, 100_000_000, [80.0, 80.0, 80.0], rtn_ppl, 1000),
        Row("fp8", "bfloat16 dense + FP8 KV", None, 270_000_000, [40.0, 40.0, 40.0], fp8_ppl, 1000),
    ]


GGUF_TENSOR_BYTES = 96_000_000


def test_bars_pass_and_fail_on_the_figures():
    got = {b.text: b.result == "PASS" for b in bars(_rows(), GGUF_TENSOR_BYTES)}
    assert all(got.values()), got
    got = {b.text: b.result == "PASS" for b in bars(_rows(awq_ppl=11.2, rtn_ppl=11.1, fp8_ppl=10.3), GGUF_TENSOR_BYTES)}
    assert not got["AWQ g32 perplexity within 8% of dense"]
    assert not got["AWQ g32 perplexity strictly better than round-to-nearest g32"]
    assert not got["FP8 KV perplexity within 2% of bf16 KV"]
    assert got["packed GGUF resident weights <= 1.15x the GGUF tensor bytes"]


def test_render_has_every_row_and_ratio():
    result = report(
        _rows(),
        command="ember bench quant",
        gguf_path="x.gguf",
        gguf_tensor_bytes=GGUF_TENSOR_BYTES,
        notes=["n"],
        load_at_start=None,
    )
    result.machine = {
        "cpu": "cpu",
        "usable_cores": 2,
        "avx512_bf16": True,
        "ram_gib": 24,
        "os": "linux",
        "python": "3.11",
        "torch": "2.13",
        "transformers": "5",
        "ember": "source",
        "torch_threads": 2,
        "date": "today",
    }
    text = result.to_markdown()
    assert "| GGUF Q4_1 packed | 101.0 | 1.05 | 81.0 (80.0–82.0) | 2.02 | 10.050 | +0.50% |" in text
    assert text.count("PASS") == 5


def test_variants_pair_awq_and_rtn_per_group_size():
    vs = variants({64: {"awq": "a64", "rtn": "r64"}, 32: {"awq": "a32", "rtn": "r32"}}, "bfloat16")
    assert [(v.kind, v.group_size) for v in vs if v.kind in ("awq", "rtn")] == [
        ("awq", 64),
        ("rtn", 64),
        ("awq", 32),
        ("rtn", 32),
    ]
    assert next(v for v in vs if v.kind == "fp8").engine_kwargs["kv_cache_dtype"] == "fp8"
