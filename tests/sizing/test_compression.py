"""`kvtier size --compression`: the object tier sized in stored bytes, the host tier raw."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from sizing_helpers import model

from kvtier.cli.main import main
from kvtier.sizing import compression as cz

LLAMA = model("llama3-8b")  # 32 layers, 8 KV heads x 128, bf16: 131,072 B / token
DEEPSEEK = model("deepseek-v3")  # MLA: one object per chunk whatever the TP


def size_json(capsys: Any, *argv: str) -> dict[str, Any]:
    assert main(["size", *argv, "--json"]) == 0
    plan: dict[str, Any] = json.loads(capsys.readouterr().out)
    return plan


def fp8_object(values: int) -> int:
    """One rank's object of ``values`` bf16 values as fp8: values + scales + header."""
    return values + 4 * math.ceil(values / 128) + 8


@pytest.mark.parametrize("tp", [1, 2, 8])
def test_fp8_is_exact_per_rank_object(capsys: Any, tp: int) -> None:
    p = size_json(
        capsys, "--model", LLAMA, "--tp", str(tp), "--compression", "fp8", "--chunk-size", "256"
    )
    rank_values = 256 * 131_072 // tp // 2
    c = p["object_compression"]
    assert c["setting"] == "fp8" and c["chunk_size"] == 256
    assert c["raw_chunk_bytes"] == 256 * 131_072
    assert c["stored_chunk_bytes"] == tp * fp8_object(rank_values)
    assert c["ratio"] == tp * fp8_object(rank_values) / (256 * 131_072)
    assert 0.515625 < c["ratio"] < 0.51563  # (1 + 4/128) / 2, plus the 8-byte headers
    assert "exact" in c["ratio_source"]
    assert p["object_stored_bytes_per_token"] == c["stored_chunk_bytes"] / 256
    # the raw figure and the host tier are unchanged
    assert p["object_kv_bytes_per_token"] == 131_072
    plain = size_json(capsys, "--model", LLAMA, "--tp", str(tp))
    for k in ("kv_bytes_per_token_per_rank", "host_tier_bytes", "host_bytes_total"):
        assert p[k] == plain[k]


def test_fp8_of_a_short_block_and_mla(capsys: Any) -> None:
    # 100 values: one (short) block, one scale
    assert cz.resolve("fp8", 2).stored_bytes(200) == 100 + 4 + 8
    p = size_json(
        capsys, "--model", DEEPSEEK, "--tp", "8", "--compression", "fp8", "--chunk-size", "16"
    )
    c = p["object_compression"]
    raw = p["kv_bytes_per_token_per_rank"] * 16  # MLA: rank 0's object alone
    assert c["raw_chunk_bytes"] == raw
    assert c["stored_chunk_bytes"] == fp8_object(raw // 2)


@pytest.mark.parametrize("kv_dtype", ["fp8", "fp8_e4m3", "fp8_e5m2"])
def test_fp8_leaves_fp8_kv_as_it_is(capsys: Any, kv_dtype: str) -> None:
    p = size_json(capsys, "--model", LLAMA, "--kv-cache-dtype", kv_dtype, "--compression", "fp8")
    c = p["object_compression"]
    assert c["ratio"] == 1.0 and c["stored_chunk_bytes"] == c["raw_chunk_bytes"]
    assert "stored as it is" in c["ratio_source"]


def test_fp32_kv_is_stored_as_it_is() -> None:
    comp = cz.resolve("fp8", 4)
    assert comp.stored_bytes(4096) == 4096 and comp.ratio(4096) == 1.0


def test_the_format_restated_here_is_kvtiers() -> None:
    """sizing restates the fp8 format (kvtier.objects.compress needs torch for it): check both
    agree, down to the length of a real fp8 stream."""
    torch = pytest.importorskip("torch")
    from kvtier.config import COMPRESSIONS
    from kvtier.objects import compress

    assert cz.COMPRESSIONS == COMPRESSIONS
    assert cz.FP8_BLOCK == compress.FP8_BLOCK
    assert cz.FP8_HEADER_BYTES == compress._FP8_HEAD.size
    for values in (128, 1000, 4096):
        x = torch.randn(values).to(torch.bfloat16)
        raw = memoryview(x.view(torch.uint8).numpy())
        got = compress.Fp8Compressor().compress_chunk(raw, "bfloat16")
        assert got is not None
        assert len(got[1]) == cz.resolve("fp8", 2).stored_bytes(raw.nbytes) == fp8_object(values)


def test_lossless_default_is_the_documented_measurement(capsys: Any) -> None:
    p = size_json(capsys, "--model", LLAMA, "--compression", "lossless")
    c = p["object_compression"]
    assert c["ratio"] == cz.LOSSLESS_RATIO == 0.705
    assert (
        "docs/performance.md" in c["ratio_source"]
        and "kvtier:compress_stored_bytes_total" in c["ratio_source"]
    )
    assert c["stored_chunk_bytes"] == math.ceil(256 * 131_072 * 0.705)
    measured = (Path(__file__).resolve().parents[2] / "docs" / "performance.md").read_text()
    assert "| **0.705** |" in measured  # the measurement the constant comes from


def test_lossless_override(capsys: Any) -> None:
    p = size_json(
        capsys,
        "--model",
        LLAMA,
        "--tp",
        "2",
        "--compression",
        "lossless",
        "--compression-ratio",
        "0.5",
    )
    c = p["object_compression"]
    assert c["ratio"] == 0.5 and c["ratio_source"] == "--compression-ratio"
    assert c["stored_chunk_bytes"] == 2 * (256 * 65_536 // 2)
    assert p["object_stored_bytes_per_token"] == 65_536


def test_lossless_of_fp8_kv_is_sized_raw_unless_told(capsys: Any) -> None:
    p = size_json(capsys, "--model", LLAMA, "--kv-cache-dtype", "fp8", "--compression", "lossless")
    assert p["object_compression"]["ratio"] == 1.0
    assert "not measured" in p["object_compression"]["ratio_source"]
    p = size_json(
        capsys,
        "--model",
        LLAMA,
        "--kv-cache-dtype",
        "fp8",
        "--compression",
        "lossless",
        "--compression-ratio",
        "0.9",
    )
    assert p["object_compression"]["ratio"] == 0.9


def test_none_is_raw(capsys: Any) -> None:
    c = size_json(capsys, "--model", LLAMA)["object_compression"]
    assert c["setting"] == "none" and c["ratio"] == 1.0
    assert c["stored_chunk_bytes"] == c["raw_chunk_bytes"]


def test_text_report_shows_the_ratio_and_its_source(capsys: Any) -> None:
    assert main(["size", "--model", LLAMA, "--compression", "lossless"]) == 0
    out = capsys.readouterr().out
    assert "stored (lossless)" in out and "0.705 x raw" in out and "docs/performance.md" in out
    assert main(["size", "--model", LLAMA]) == 0
    assert "stored (" not in capsys.readouterr().out


@pytest.mark.parametrize(
    "flags,named",
    [
        (("--compression", "zstd"), "--compression: invalid choice"),
        (("--compression", "lossless", "--compression-ratio", "0"), "--compression-ratio"),
        (("--compression", "lossless", "--compression-ratio", "1.5"), "--compression-ratio"),
        (("--compression", "lossless", "--compression-ratio", "-0.3"), "--compression-ratio"),
        (("--compression", "lossless", "--compression-ratio", "nan"), "--compression-ratio"),
        (("--compression", "lossless", "--compression-ratio", "inf"), "--compression-ratio"),
        (("--compression", "lossless", "--compression-ratio", "half"), "--compression-ratio"),
    ],
)
@pytest.mark.parametrize("trace", [False, True])
def test_bad_values_are_usage_errors(
    capsys: Any, tmp_path: Path, flags: tuple[str, ...], named: str, trace: bool
) -> None:
    extra: tuple[str, ...] = ()
    if trace:
        path = tmp_path / "t.jsonl"
        path.write_text(json.dumps({"prompt_token_ids": list(range(40))}) + "\n")
        extra = ("--trace", str(path))
    with pytest.raises(SystemExit) as e:
        main(["size", "--model", LLAMA, *extra, *flags])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "usage:" in err and f"argument {named}: " in err and "Traceback" not in err


@pytest.mark.parametrize("setting", ["none", "fp8"])
def test_a_ratio_is_for_lossless_only(capsys: Any, setting: str) -> None:
    assert (
        main(["size", "--model", LLAMA, "--compression", setting, "--compression-ratio", "0.7"])
        == 2
    )
    err = capsys.readouterr().err
    assert "--compression-ratio applies to --compression lossless or auto only" in err


def test_chunk_size_zero_is_refused(capsys: Any) -> None:
    assert main(["size", "--model", LLAMA, "--chunk-size", "0"]) == 2
    assert "kvtier config 'chunk_size'" in capsys.readouterr().err  # the connector's words


def test_trace_sizes_the_object_tier_stored_and_the_host_tier_raw(
    capsys: Any, tmp_path: Path
) -> None:
    path = tmp_path / "t.jsonl"
    lines = [{"prompt_token_ids": list(range(i % 3 * 1000, i % 3 * 1000 + 600))} for i in range(30)]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    common = [
        "size",
        "--model",
        LLAMA,
        "--trace",
        str(path),
        "--gpu-kv-tokens",
        "0",
        "--block-size",
        "16",
        "--chunk-size",
        "64",
        "--cpu-bytes",
        str(2 * 2**24),
        "--json",
    ]
    reps = {}
    for setting, extra in (
        ("none", []),
        ("fp8", []),
        ("lossless", []),
        ("lossless-0.4", ["--compression-ratio", "0.4"]),
    ):
        assert main([*common, "--compression", setting.split("-")[0], *extra]) == 0
        reps[setting] = json.loads(capsys.readouterr().out)
    raw = 64 * 131_072
    none, fp8 = reps["none"], reps["fp8"]
    assert none["keys"]["object_chunk_bytes"] == raw
    assert fp8["keys"]["object_chunk_bytes"] == fp8_object(raw // 2)
    assert reps["lossless"]["keys"]["object_chunk_bytes"] == math.ceil(raw * 0.705)
    assert reps["lossless-0.4"]["keys"]["object_chunk_bytes"] == math.ceil(raw * 0.4)
    assert fp8["keys"]["object_compression"]["setting"] == "fp8"
    assert (
        reps["lossless-0.4"]["keys"]["object_compression"]["ratio_source"] == "--compression-ratio"
    )
    # the same curve over chunks; object bytes scale, host bytes do not
    assert [p["chunks"] for p in fp8["object_tier"]["curve"]] == [
        p["chunks"] for p in none["object_tier"]["curve"]
    ]
    assert fp8["object_tier"]["curve"], "the trace must reach past the host tier"
    for a, b in zip(fp8["object_tier"]["curve"], none["object_tier"]["curve"], strict=True):
        assert a["bytes"] == a["chunks"] * fp8_object(raw // 2)
        assert a["hit_rate"] == b["hit_rate"] and b["bytes"] == b["chunks"] * raw
    assert fp8["host_tier"] == none["host_tier"]
    assert fp8["keys"]["host_slot_bytes"] == none["keys"]["host_slot_bytes"] == raw
    assert fp8["object_tier"]["behind_host_bytes"] == none["object_tier"]["behind_host_bytes"]
    assert fp8["recommended"]["host_bytes"] == none["recommended"]["host_bytes"]
    ob_none, ob_fp8 = none["recommended"]["object_bytes"], fp8["recommended"]["object_bytes"]
    assert ob_none is not None and ob_fp8 == ob_none // raw * fp8_object(raw // 2)
    # the text report says which ratio and where it comes from
    assert main([*common[:-1], "--compression", "lossless"]) == 0
    out = capsys.readouterr().out
    assert "object compression lossless: stored = 0.705 x raw (measured" in out


def test_emit_writes_the_setting(capsys: Any) -> None:
    assert (
        main(
            ["size", "--model", LLAMA, "--emit", "kv-transfer-config", "--compression", "lossless"]
        )
        == 0
    )
    extra = json.loads(capsys.readouterr().out)["kv_connector_extra_config"]
    assert extra["compression"] == "lossless"
    assert main(["size", "--model", LLAMA, "--emit", "kv-transfer-config"]) == 0
    assert "compression" not in json.loads(capsys.readouterr().out)["kv_connector_extra_config"]
    assert main(["size", "--model", LLAMA, "--emit", "helm-values", "--compression", "fp8"]) == 0
    assert '  extraConfig:\n    compression: "fp8"' in capsys.readouterr().out


def test_emitted_compression_loads_in_kvtier(capsys: Any) -> None:
    from kvtier.config import load_config

    assert (
        main(["size", "--model", LLAMA, "--emit", "kv-transfer-config", "--compression", "fp8"])
        == 0
    )
    extra = json.loads(capsys.readouterr().out)["kv_connector_extra_config"]
    assert load_config(extra).compression == "fp8"


def test_help_says_where_an_operator_ratio_comes_from() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvtier.cli.main", "size", "--help"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    flat = " ".join(out.split())
    assert "--compression {none,lossless,auto,fp8}" in flat
    assert "kvtier:compress_stored_bytes_total / kvtier:compress_raw_bytes_total" in flat


def test_emitted_helm_values_pass_the_chart_schema(capsys: Any) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    yaml = pytest.importorskip("yaml")
    chart = Path(__file__).resolve().parents[2] / "deploy" / "helm" / "kvtier"
    assert (
        main(["size", "--model", LLAMA, "--emit", "helm-values", "--compression", "lossless"]) == 0
    )
    doc = yaml.safe_load(capsys.readouterr().out)
    values = yaml.safe_load((chart / "values.yaml").read_text())
    for section, block in doc.items():
        values[section] = (
            {**(values.get(section) or {}), **block} if isinstance(block, dict) else block
        )
    assert values["kvtier"]["extraConfig"] == {"compression": "lossless"}
    jsonschema.validate(values, json.loads((chart / "values.schema.json").read_text()))


def test_doctor_sizes_the_object_tier_with_the_logged_compression(
    capsys: Any, tmp_path: Path
) -> None:
    from sizing_helpers import LOGS

    text = (LOGS / "vllm-0.32-kvtier-ok.log").read_text()
    assert '"chunk_size": 256, ' in text
    log = tmp_path / "fp8.log"
    log.write_text(text.replace('"chunk_size": 256, ', '"chunk_size": 64, "compression": "fp8", '))
    main(["doctor", str(log), "--model", LLAMA, "--json"])
    c = json.loads(capsys.readouterr().out)["plan"]["object_compression"]
    assert c["setting"] == "fp8" and c["chunk_size"] == 64
    assert c["stored_chunk_bytes"] == fp8_object(64 * 131_072 // 2)
    main(["doctor", str(LOGS / "vllm-0.32-kvtier-ok.log"), "--model", LLAMA, "--json"])
    c = json.loads(capsys.readouterr().out)["plan"]["object_compression"]
    assert c["setting"] == "none" and c["chunk_size"] == 256


def test_auto_is_sized_raw_unless_a_measured_ratio_is_given(capsys: Any) -> None:
    """``auto`` stores compressed only where reads are faster so, which a plan cannot know:
    the object tier is sized raw (its most), or with the operator's measured ratio."""
    p = size_json(capsys, "--model", LLAMA, "--compression", "auto", "--chunk-size", "256")
    c = p["object_compression"]
    assert c["setting"] == "auto" and c["ratio"] == 1.0
    assert c["stored_chunk_bytes"] == c["raw_chunk_bytes"] == 256 * 131_072
    assert "sized raw" in c["ratio_source"]
    p = size_json(
        capsys,
        "--model",
        LLAMA,
        "--compression",
        "auto",
        "--compression-ratio",
        "0.8",
        "--chunk-size",
        "256",
    )
    c = p["object_compression"]
    assert c["ratio"] == 0.8 and c["stored_chunk_bytes"] == math.ceil(256 * 131_072 * 0.8)
    assert c["ratio_source"] == "--compression-ratio"
    assert (
        main(["size", "--model", LLAMA, "--emit", "kv-transfer-config", "--compression", "auto"])
        == 0
    )
    from kvtier.config import load_config

    extra = json.loads(capsys.readouterr().out)["kv_connector_extra_config"]
    assert load_config(extra).compression == "auto"
