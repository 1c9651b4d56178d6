"""``kvtier size`` for hybrid models with recurrent state (issue 53): one state per state
layer per chunk, bytes equal to vLLM's own ``MambaSpec`` page.

kvtier's sizing never imports vLLM, so it writes vLLM's shape and dtype rules out; these
tests hold them to vLLM's: each model class's ``get_mamba_state_shape_from_config`` and
``get_mamba_state_dtype_from_config`` over the config as transformers reads it, vLLM's
``MambaSpec.page_size_bytes``, and the CPU platform's own ``_align_hybrid_block_size``
over a real ``VllmConfig`` (the block size it raises and the page it pads the state to).
They used to fail on a refusal: ``kvtier size`` refused every model with a state group.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from transformers import AutoConfig
from vllm.model_executor.models.registry import ModelRegistry
from vllm.v1.kv_cache_interface import MambaSpec

from kvtier.cli.main import main
from kvtier.errors import ConfigError
from kvtier.sizing.memory_plan import PlanInputs, make_plan
from kvtier.sizing.model import load_shape, shape_from_config
from kvtier.sizing.validate import check_deployment, check_model_shape

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "models"
TORCH = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}

#: small configs of the hybrid families without a fixture directory (values of the
#: public Nemotron-H and LFM2 configs' kind, sized down)
NEMOTRON_H: dict[str, Any] = {
    "architectures": ["NemotronHForCausalLM"],
    "model_type": "nemotron_h",
    "num_hidden_layers": 8,
    "hybrid_override_pattern": "M-M*M-M*",
    "hidden_size": 512,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "mamba_num_heads": 16,
    "mamba_head_dim": 32,
    "n_groups": 2,
    "ssm_state_size": 64,
    "conv_kernel": 4,
    "intermediate_size": 1024,
    "vocab_size": 1000,
    "torch_dtype": "bfloat16",
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
}
LFM2: dict[str, Any] = {
    "architectures": ["Lfm2ForCausalLM"],
    "model_type": "lfm2",
    "num_hidden_layers": 6,
    "layer_types": ["conv", "conv", "full_attention", "conv", "conv", "full_attention"],
    "hidden_size": 1024,
    "conv_dim": 1024,
    "conv_L_cache": 3,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "intermediate_size": 2048,
    "vocab_size": 1000,
    "torch_dtype": "bfloat16",
    "max_position_embeddings": 4096,
}


def write(tmp_path: Path, name: str, cfg: dict[str, Any]) -> str:
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    return str(d)


@pytest.fixture
def models(tmp_path: Path) -> dict[str, str]:
    """Model directories by name: the fixtures and the inline configs."""
    return {
        "granite-4.0-h-tiny": str(FIXTURES / "granite-4.0-h-tiny"),
        "qwen3-next-80b-a3b": str(FIXTURES / "qwen3-next-80b-a3b"),
        "jamba-v0.1": str(FIXTURES / "jamba-v0.1"),
        "nemotron-h": write(tmp_path, "nemotron-h", NEMOTRON_H),
        "lfm2": write(tmp_path, "lfm2", LFM2),
    }


def vllm_state(
    model_dir: str, tp: int, mamba_cache_dtype: str = "auto", mamba_ssm_cache_dtype: str = "auto"
) -> tuple[tuple, tuple, int]:
    """vLLM's shapes, dtypes and MambaSpec page of one state layer on one of ``tp`` ranks,
    from the model class vLLM runs, over the config as transformers reads it."""
    hf = AutoConfig.from_pretrained(model_dir)
    cls = ModelRegistry._try_load_model_cls(hf.architectures[0])
    assert cls is not None
    cache = SimpleNamespace(
        mamba_cache_dtype=mamba_cache_dtype,
        mamba_ssm_cache_dtype=mamba_ssm_cache_dtype,
        use_replayssm=False,
    )
    if hf.model_type == "nemotron_h":  # what vLLM's NemotronHForCausalLMConfig does at startup
        from vllm.model_executor.models.config import NemotronHForCausalLMConfig

        NemotronHForCausalLMConfig.update_mamba_ssm_cache_dtype(cache_config=cache, hf_config=hf)  # type: ignore[arg-type]
    vc = SimpleNamespace(
        model_config=SimpleNamespace(hf_config=hf, hf_text_config=hf, dtype=torch.bfloat16),
        parallel_config=SimpleNamespace(tensor_parallel_size=tp),
        cache_config=cache,
        num_speculative_tokens=0,
        speculative_config=None,
    )
    shapes = cls.get_mamba_state_shape_from_config(vc)
    dtypes = cls.get_mamba_state_dtype_from_config(vc)
    return shapes, dtypes, MambaSpec(shapes=shapes, dtypes=dtypes, block_size=16).page_size_bytes


CASES = [
    ("granite-4.0-h-tiny", "mamba2", 36),
    ("qwen3-next-80b-a3b", "gated_delta_net", 36),
    ("jamba-v0.1", "mamba1", 28),
    ("nemotron-h", "mamba2", 4),
    ("lfm2", "short_conv", 4),
]


@pytest.mark.parametrize(("name", "kind", "layers"), CASES)
@pytest.mark.parametrize("tp", [1, 2])
def test_state_bytes_per_chunk_are_vllms_mambaspec_page(
    models: dict[str, str], name: str, kind: str, layers: int, tp: int
) -> None:
    """Shapes, dtypes and bytes of one state equal vLLM's; the plan stores one state per
    state layer per chunk, whatever the chunk's length."""
    shapes, dtypes, page = vllm_state(models[name], tp)
    shape = load_shape(models[name])
    spec = shape.state_spec(tp)
    assert spec is not None and spec.kind == kind and spec.layers == layers
    assert spec.shapes == tuple(tuple(s) for s in shapes)
    assert [TORCH[d] for d in spec.dtypes] == list(dtypes)
    assert spec.bytes_per_layer == page
    for chunk_blocks in (1, 3):
        _, block = shape.engine_state(16, tp=tp)
        plan = make_plan(PlanInputs(model=models[name], tp=tp, chunk_size=block * chunk_blocks))
        assert plan["state_bytes_per_chunk"] == layers * page
        (group,) = [g for g in plan["kv_groups"] if g["kind"] == "state"]
        assert group["chunk_bytes"] == layers * page and group["state_kind"] == kind
        attention = sum(g["chunk_bytes"] for g in plan["kv_groups"] if g["kind"] != "state")
        assert attention == shape.kv_bytes_per_token(tp=tp) * block * chunk_blocks
        assert plan["host_chunk_bytes_per_rank"] == attention + layers * page


@pytest.mark.parametrize(
    ("conv", "ssm"), [("auto", "float32"), ("float16", "auto"), ("auto", "bfloat16")]
)
@pytest.mark.parametrize("name", ["granite-4.0-h-tiny", "qwen3-next-80b-a3b", "nemotron-h"])
def test_state_dtypes_follow_vllms_flags(
    models: dict[str, str], name: str, conv: str, ssm: str
) -> None:
    """--mamba-cache-dtype / --mamba-ssm-cache-dtype as vLLM resolves them (Nemotron-H's
    auto is float32, from its config)."""
    _, dtypes, page = vllm_state(models[name], 1, conv, ssm)
    spec = load_shape(models[name]).state_spec(1, mamba_cache_dtype=conv, mamba_ssm_cache_dtype=ssm)
    assert spec is not None and [TORCH[d] for d in spec.dtypes] == list(dtypes)
    assert spec.bytes_per_layer == page


def test_tp2_halves_the_heads_as_vllm_does(models: dict[str, str]) -> None:
    """Granite-4.0-H-Tiny: 48 Mamba heads, one group of 128 replicated to two at TP 2
    (conv channels (3072 + 2 x 2 x 128) / 2 = 1792, not 3328 / 2); Qwen3-Next: 32 value
    heads, conv channels 8192 split."""
    granite = load_shape(models["granite-4.0-h-tiny"])
    one, two = granite.state_spec(1), granite.state_spec(2)
    assert one is not None and two is not None
    assert one.shapes == ((3, 3328), (48, 64, 128))
    assert two.shapes == ((3, 1792), (24, 64, 128))
    assert two.shapes == vllm_state(models["granite-4.0-h-tiny"], 2)[0]
    qwen = load_shape(models["qwen3-next-80b-a3b"]).state_spec(2)
    assert qwen is not None and qwen.shapes == ((3, 4096), (16, 128, 128))


def test_a_state_tp_vllm_cannot_divide_is_refused(tmp_path: Path) -> None:
    """6 Mamba heads over 4 ranks: vLLM's divide asserts, kvtier refuses the TP size."""
    cfg = {**NEMOTRON_H, "mamba_num_heads": 6, "num_key_value_heads": 8}
    shape = shape_from_config(cfg)
    with pytest.raises(ConfigError) as err:
        check_deployment({"chunk_size": 4096}, shape=shape, model="m", tp=4)
    assert err.value.key == "tensor_parallel_size" and "6 Mamba heads" in str(err.value)
    from vllm.distributed import divide

    with pytest.raises(AssertionError):
        divide(6, 4)


@pytest.mark.isa
def test_vllm_cpu_raises_the_block_and_pads_the_state_page_as_planned(
    models: dict[str, str],
) -> None:
    """vLLM's CPU platform over a real VllmConfig (prefix caching, align mode): the block
    size it raises --block-size 16 to and the page it pads each state to are the plan's.
    With AVX512-BF16 the CPU build keeps the SSM state in float32; without it (AVX2-only
    CPUs) in the dtype asked for ("auto": the model's)."""
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    model = models["granite-4.0-h-tiny"]
    vc = VllmConfig(
        model_config=ModelConfig(
            model=model, dtype="bfloat16", skip_tokenizer_init=True, max_model_len=4096
        ),
        cache_config=CacheConfig(block_size=16, enable_prefix_caching=True),
        scheduler_config=SchedulerConfig(
            max_num_batched_tokens=4096,
            max_model_len=4096,
            enable_chunked_prefill=True,
            is_encoder_decoder=False,
        ),
    )
    current_platform._align_hybrid_block_size(vc, CPUAttentionBackend)
    cache = vc.cache_config
    assert cache.mamba_cache_mode == "align"
    shape = load_shape(model)
    spec, block = shape.engine_state(16, cpu_build=True, mamba_ssm_cache_dtype="auto")
    assert spec is not None
    if torch.cpu._is_avx512_bf16_supported():
        assert cache.mamba_ssm_cache_dtype == spec.dtypes[1] == "float32"
        assert block == cache.block_size == cache.mamba_block_size == 800
    else:  # the state as the model asks: the plan's smaller state and block are vLLM's
        assert cache.mamba_ssm_cache_dtype == "auto"
        assert spec.dtypes == shape.engine_state(16, mamba_ssm_cache_dtype="auto")[0].dtypes
        assert block == cache.block_size == cache.mamba_block_size < 800
    # both branches, whatever this host has: the other CPU's plan is the other state
    other, other_block = shape.engine_state(
        16, cpu_build=True, cpu_avx512_bf16=not torch.cpu._is_avx512_bf16_supported()
    )
    assert other is not None and (other.dtypes[1] == "float32") != (spec.dtypes[1] == "float32")
    assert {block, other_block} == {800, min(block, other_block)} and block != other_block
    plan = make_plan(PlanInputs(model=model, chunk_size=block, cpu_kv_space_bytes=2**30))
    assert plan["engine_block_size"] == block
    assert plan["state_padded_page_bytes"] == cache.mamba_page_size_padded
    assert (
        plan["state_bytes_per_layer"]
        == MambaSpec(
            shapes=spec.shapes, dtypes=tuple(TORCH[d] for d in spec.dtypes), block_size=block
        ).page_size_bytes
    )


def test_gpu_block_and_padding_never_under_count(models: dict[str, str]) -> None:
    """On a GPU (16-token kernel steps) Granite-4.0-H-Tiny's 806,400-byte state needs
    400-token blocks of 2,048 B a layer a token: the state page is padded to 819,200 B,
    and a session holds its attention KV in whole blocks plus two padded state pages a
    state layer."""
    model = models["granite-4.0-h-tiny"]
    plan = make_plan(
        PlanInputs(model=model, chunk_size=400, context=1000, gpu_kv_gib=10, warm_sessions=10)
    )
    assert plan["engine_block_size"] == 400
    assert plan["state_bytes_per_layer"] == 806_400
    assert plan["state_padded_page_bytes"] == 400 * 2048 == 819_200
    attention = plan["kv_bytes_per_token_per_rank"] * 1200  # 1,000 tokens in 400-token blocks
    assert plan["session_kv_bytes_per_rank"] == attention + 36 * 819_200 * 2
    assert plan["gpu_kv_sessions"] == 10 * 2**30 // plan["session_kv_bytes_per_rank"]
    # the warm set: every token's KV and one state a layer per whole chunk (two of them)
    assert plan["warm_set_bytes"] == 10 * (
        plan["kv_bytes_per_token_per_rank"] * 1000 + 2 * 36 * 806_400
    )


def test_a_plan_for_jamba_now_succeeds(capsys: pytest.CaptureFixture[str]) -> None:
    """Jamba v0.1 used to be refused (Mamba layers); it is planned with its 28 Mamba1
    states per chunk, in the 80-token blocks vLLM raises 16 to."""
    argv = [
        "size",
        "--model",
        str(FIXTURES / "jamba-v0.1"),
        "--chunk-size",
        "320",
        "--gpu-memory",
        "80",
        "--tp",
        "2",
        "--warm-sessions",
        "10",
        "--json",
    ]
    assert main(argv) == 0, capsys.readouterr().err
    plan = json.loads(capsys.readouterr().out)
    assert plan["state_layers"] == 28 and plan["state_kind"] == "mamba1"
    assert plan["state_bytes_per_layer"] == (3 * 4096 + 4096 * 16) * 2
    assert plan["engine_block_size"] == 80  # 8 KV heads / 2 x 128 x 2 x 2 B a token
    assert main(argv[:-1]) == 0
    table = capsys.readouterr().out
    assert "state group (mamba1)" in table and "28 mamba layers" in table


def test_a_chunk_size_off_the_raised_block_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    """The default 256-token chunk is no multiple of Jamba's 80-token blocks: the engine
    would refuse it, and kvtier size says which chunk size lines up."""
    assert main(["size", "--model", str(FIXTURES / "jamba-v0.1")]) == 2
    err = capsys.readouterr().err
    assert "kvtier config 'chunk_size'" in err and "80-token block" in err and "320" in err


@pytest.mark.parametrize(
    ("cfg", "named"),
    [
        (
            {
                "model_type": "falcon_h1",
                "architectures": ["FalconH1ForCausalLM"],
                "num_hidden_layers": 4,
                "num_attention_heads": 8,
                "num_key_value_heads": 2,
                "hidden_size": 512,
                "mamba_d_ssm": 1024,
                "mamba_n_heads": 16,
                "mamba_d_state": 64,
            },
            "'mamba' (recurrent-state) layers of model type 'falcon_h1'",
        ),
        (
            {
                "model_type": "kimi_linear",
                "num_hidden_layers": 4,
                "num_attention_heads": 8,
                "hidden_size": 512,
                "layer_types": ["kda", "kda", "kda", "full_attention"],
            },
            "'kda' layers of model type 'kimi_linear'",
        ),
    ],
)
def test_state_kvtier_cannot_size_is_refused_naming_the_layer_type(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], cfg: dict[str, Any], named: str
) -> None:
    """Falcon-H1 (Mamba beside attention in every layer) was planned as attention alone;
    Kimi's KDA layers were refused as 'Mamba/SSM'. Both are refused naming the type."""
    model = write(tmp_path, cfg["model_type"], cfg)
    with pytest.raises(ConfigError) as err:
        check_model_shape(load_shape(model), model)
    assert err.value.key == "model" and named in str(err.value)
    assert main(["size", "--model", model]) == 2
    out = capsys.readouterr().err
    assert named in out and "serve it without kvtier's connector" in out


@pytest.mark.parametrize(
    "name", ["granite-4.0-h-tiny", "qwen3-next-80b-a3b", "jamba-v0.1", "nemotron-h", "lfm2"]
)
def test_weights_from_the_config_count_the_state_layers_mixers(
    models: dict[str, str], name: str
) -> None:
    """Without a checkpoint the plan counts weights from the config: a state layer's
    mixer (Mamba in/out projections, GDN's qkvz, the short conv's) used to count as
    nothing, 7.6% of Granite-4.0-H-Tiny's weights, 5.7% of Jamba's, so GPU KV was
    over-stated. Now within 0.5% of the model transformers builds (on the meta device)."""
    from transformers import AutoModelForCausalLM

    from kvtier.sizing.weights import weights_from_config

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(models[name]))
    want = sum(p.numel() for p in model.parameters())
    w = weights_from_config(load_shape(models[name]))
    got = sum(t.numel for layer in w.layers for t in layer) + sum(t.numel for t in w.other)
    assert abs(got - want) <= 0.005 * want, (got, want)


def test_emit_gives_vllm_the_flags_the_plan_counted(capsys: pytest.CaptureFixture[str]) -> None:
    """--emit vllm-args for a hybrid model: prefix caching in align mode (vLLM keeps the
    state at block boundaries only then) and the raised block size the chunks line up
    with; a model without state gets none of them."""
    granite = str(FIXTURES / "granite-4.0-h-tiny")
    assert (
        main(
            [
                "size",
                "--model",
                granite,
                "--chunk-size",
                "784",
                "--emit",
                "vllm-args",
                "--mamba-ssm-cache-dtype",
                "float32",
            ]
        )
        == 0
    )
    line = capsys.readouterr().out
    want = (
        "--enable-prefix-caching --mamba-cache-mode align --block-size 784 "
        "--mamba-ssm-cache-dtype float32"
    )
    assert want in line and '"chunk_size":784' in line
    assert main(["size", "--model", str(FIXTURES / "llama3-8b"), "--emit", "vllm-args"]) == 0
    line = capsys.readouterr().out
    assert "--mamba-cache-mode" not in line and "--block-size" not in line


@pytest.mark.parametrize(("attention", "conv"), [(6, 10), (4, 4), (2, 6), (3, 4)])
def test_gpu_pays_for_the_group_padding_vllm_adds(
    tmp_path: Path, attention: int, conv: int
) -> None:
    """vLLM's own grouping (``_get_kv_cache_groups_uniform_page_size``) of LFM2-like
    models: every group holds as many layers, the last of a kind padded. LFM2-1.2B's 6
    attention and 10 conv layers are 2 groups of 6 conv layers: 12 state pages a block,
    not 10; the plan's sessions count them."""
    from vllm.v1.core.kv_cache_utils import _get_kv_cache_groups_uniform_page_size
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from kvtier.sizing.memory_plan import gpu_group_layers

    types = ["full_attention"] * attention + ["conv"] * conv
    cfg = {**LFM2, "num_hidden_layers": len(types), "layer_types": types}
    shape = load_shape(write(tmp_path, "m", cfg))
    full = FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=64, dtype=torch.bfloat16)
    state = MambaSpec(
        block_size=16,
        shapes=((2, 1024),),
        dtypes=(torch.bfloat16,),
        page_size_padded=full.page_size_bytes,
    )
    specs = {f"layers.{i}": full if t == "full_attention" else state for i, t in enumerate(types)}
    groups = _get_kv_cache_groups_uniform_page_size(specs)
    size = max(len(g.layer_names) for g in groups)
    want = {
        kind: size * sum(1 for g in groups if type(g.kv_cache_spec) is cls)
        for kind, cls in (("full", FullAttentionSpec), ("state", MambaSpec))
    }
    got = gpu_group_layers(shape, conv)
    assert (got[0], got[2]) == (want["full"], want["state"])
    plan = make_plan(PlanInputs(model=str(tmp_path / "m"), chunk_size=16, context=16))
    assert plan["gpu_group_layers"]["state"] == want["state"]
    per_layer_token = plan["kv_bytes_per_token_per_rank"] // attention
    assert plan["session_kv_bytes_per_rank"] == (
        want["full"] * 16 * per_layer_token + want["state"] * plan["state_padded_page_bytes"] * 2
    )


def test_qwen3_5_reads_its_text_config_and_ssm_dtype(tmp_path: Path) -> None:
    """Qwen3.5 nests the decoder under text_config and asks for its SSM state dtype there
    (mamba_ssm_dtype), which vLLM takes when --mamba-ssm-cache-dtype is auto. Its model
    module needs torchvision, so vLLM's calculators are called as its
    get_mamba_state_shape_from_config calls them, over the config transformers reads."""
    from vllm.model_executor.layers.mamba.mamba_utils import (
        MambaStateDtypeCalculator,
        MambaStateShapeCalculator,
    )
    from vllm.model_executor.models.config import Qwen3_5ForConditionalGenerationConfig

    text = {
        "model_type": "qwen3_5_text",
        "num_hidden_layers": 8,
        "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 2,
        "hidden_size": 1024,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
        "mamba_ssm_dtype": "float32",
        "intermediate_size": 2048,
        "vocab_size": 1000,
        "torch_dtype": "bfloat16",
    }
    model = write(
        tmp_path,
        "qwen3.5",
        {
            "architectures": ["Qwen3_5ForConditionalGeneration"],
            "model_type": "qwen3_5",
            "text_config": text,
        },
    )
    hf = AutoConfig.from_pretrained(model).get_text_config()
    cache = SimpleNamespace(mamba_ssm_cache_dtype="auto")
    Qwen3_5ForConditionalGenerationConfig.verify_and_update_config(
        SimpleNamespace(cache_config=cache, model_config=SimpleNamespace(hf_text_config=hf))  # type: ignore[arg-type]
    )
    for tp in (1, 2):
        shapes = MambaStateShapeCalculator.gated_delta_net_state_shape(
            tp,
            hf.linear_num_key_heads,
            hf.linear_num_value_heads,
            hf.linear_key_head_dim,
            hf.linear_value_head_dim,
            hf.linear_conv_kernel_dim,
            0,
        )
        dtypes = MambaStateDtypeCalculator.gated_delta_net_state_dtype(
            torch.bfloat16, "auto", cache.mamba_ssm_cache_dtype
        )
        spec = load_shape(model).state_spec(tp)
        assert spec is not None and spec.layers == 6 and spec.kind == "gated_delta_net"
        assert spec.shapes == shapes and [TORCH[d] for d in spec.dtypes] == list(dtypes)
        assert (
            spec.bytes_per_layer
            == MambaSpec(shapes=shapes, dtypes=dtypes, block_size=16).page_size_bytes
        )
    assert spec.dtypes == ("bfloat16", "float32")


@pytest.mark.parametrize("tp", [1, 2])
def test_the_plans_host_slot_is_the_connectors(tmp_path: Path, tp: int) -> None:
    """The slot kvtier size plans for an LFM2-like model (6 attention, 10 conv layers) is
    the one the connector's scheduler side sizes from vLLM's own grouping of the specs
    vLLM would give these layers: a chunk of attention KV and one unpadded state per
    state layer, rounded to 4096."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from kvtier.connectors.groups import kv_groups
    from kvtier.connectors.slots import slot_size
    from tests.connectors.hybrid_engine import BS, CHUNK
    from tests.connectors.test_recurrent_state_groups import shape_of

    types = ["conv", "conv", "full_attention"] * 2 + ["conv"] * 4 + ["full_attention"] * 2
    cfg = {**LFM2, "num_hidden_layers": len(types), "layer_types": types}
    model = write(tmp_path, "lfm2-16", cfg)
    engine = write(
        tmp_path,
        "engine",
        {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "vocab_size": 512,
            "max_position_embeddings": 4096,
            "torch_dtype": "bfloat16",
            "bos_token_id": 0,
            "eos_token_id": 1,
        },
    )
    plan = make_plan(PlanInputs(model=model, tp=tp, chunk_size=CHUNK, block_size=BS))
    assert plan["engine_block_size"] == BS
    shapes, dtypes, _ = vllm_state(model, tp)
    attn = FullAttentionSpec(
        block_size=BS, num_kv_heads=8 // tp, head_size=64, dtype=torch.bfloat16
    )
    conv = MambaSpec(
        block_size=BS,
        shapes=shapes,
        dtypes=dtypes,
        mamba_cache_mode="align",
        page_size_padded=attn.page_size_bytes,
    )
    specs = {
        f"model.layers.{i}.{'self_attn.attn' if t == 'full_attention' else 'conv'}": attn
        if t == "full_attention"
        else conv
        for i, t in enumerate(types)
    }
    kv = shape_of(engine, specs)  # type: ignore[arg-type]
    assert slot_size(kv, kv_groups(kv, BS, CHUNK), CHUNK // BS) == plan["host_slot_bytes"]
