"""ESMFold2 checkpoints (transformers' layout) converted into fold artifacts: every tensor kept as
transformers holds it, the backbone quantized exactly as an ESMC's, bad checkpoints refused
before anything is read or written; the alias, `esmc-mlx info` and a push's dry run."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import mlx.core as mx
import pytest

torch = pytest.importorskip("torch", reason="needs torch: pip install -e '.[torch]' in the clone")
from click.testing import CliRunner
from conftest_hub import hub, no_remote_network  # noqa: F401  (fixtures)
from safetensors.torch import load_file, save_file

from esmc_mlx import load
from esmc_mlx.artifact import (
    TOKENIZER_FILES,
    quantization_record,
    read_config,
    weight_files,
)
from esmc_mlx.cli import convert_main, main
from esmc_mlx.convert import convert, quantize_directory
from esmc_mlx.convert.many import convert_many
from esmc_mlx.convert.sources import open_checkpoint
from esmc_mlx.errors import ConvertError
from esmc_mlx.fold_artifact import BACKBONE, expected_fold_shapes, float32_in_transformers, keeps_float32
from esmc_mlx.fold_config import FoldConfig
from esmc_mlx.outputs import read_marker
from esmc_mlx.pipeline import default_output
from esmc_mlx.quantize import BLOCK_LINEAR
from esmc_mlx.resolve import ALIASES
from esmc_mlx.runtime.load import apply_quantization
from esmc_mlx.runtime.model import ESMC
from esmc_mlx.testing import tiny_fold_config, write_fold_checkpoint

MSA = dict(
    enabled=True,
    hidden_size=24,
    outer_hidden_size=6,
    num_hidden_layers=3,
    num_attention_heads=3,
    head_dim=5,
    intermediate_size=40,
)


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A float32 ESMFold2 with an MSA encoder (its tensors must reach the artifact too)."""
    return write_fold_checkpoint(tmp_path_factory.mktemp("fold") / "src", tiny_fold_config(msa_encoder=MSA))


@pytest.fixture(scope="module")
def half_source(tmp_path_factory):
    """A bfloat16 ESMFold2 as transformers saves one: its float32-pinned tensors float32."""
    return write_fold_checkpoint(tmp_path_factory.mktemp("fold") / "src-bf16", dtype="bfloat16", seed=1)


def artifact_tensors(directory: Path) -> dict[str, mx.array]:
    tensors = {}
    for f in weight_files(directory):
        tensors.update(mx.load(str(f)))
    return tensors


def source_tensors(directory: Path) -> dict[str, mx.array]:
    return {
        name: mx.array(t.float().numpy()).astype(_mx_dtype(t))
        for name, t in load_file(directory / "model.safetensors").items()
    }


def _mx_dtype(t) -> mx.Dtype:
    return {torch.float32: mx.float32, torch.bfloat16: mx.bfloat16, torch.float16: mx.float16}[t.dtype]


def equal(a: mx.array, b: mx.array) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and bool(mx.array_equal(a, b).item())


def no_debris(parent: Path) -> bool:
    return not [
        p.name for p in parent.iterdir() if ".partial-" in p.name or ".old-" in p.name or p.name.endswith(".lock")
    ]


# --- names and shapes -------------------------------------------------------------------------------
@pytest.mark.parametrize("which", ["tiny", "tiny with MSA", "published defaults"])
def test_expected_fold_shapes_are_transformers_state_dict(which):
    from transformers import EsmFold2Config, EsmFold2Model

    raw = {
        "tiny": tiny_fold_config(),
        "tiny with MSA": tiny_fold_config(msa_encoder=MSA),
        "published defaults": EsmFold2Config().to_dict(),  # 24 folding blocks, an MSA encoder, the 6B backbone
    }[which]
    with torch.device("meta"):  # shapes only: the 6B backbone takes no memory
        model = EsmFold2Model(EsmFold2Config.from_dict(raw))
    state = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    assert expected_fold_shapes(FoldConfig.from_dict(model.config.to_dict())) == state
    assert "confidence_head.boundaries" in state and "structure_head.conditioning.fourier.phases" in state
    assert any(n.startswith("msa_encoder.") for n in state) == (which != "tiny")


def test_float32_set_is_the_one_transformers_keeps(source):
    """The strict set matched as transformers matches it: the tensors a bfloat16 EsmFold2Model
    holds in float32 are exactly ``float32_in_transformers``; the artifact keeps those of the
    folding model (``keeps_float32``), the backbone's norms follow the ESMC rule."""
    from transformers import EsmFold2Model

    model = EsmFold2Model.from_pretrained(source, dtype=torch.bfloat16)
    kept = {name for name, t in model.state_dict().items() if t.dtype == torch.float32}
    assert kept == {name for name in model.state_dict() if float32_in_transformers(name)}
    assert {
        "parcae.log_delta",
        "esmc.norm.weight",
        "msa_encoder.layers.0.msa_pair_weighted_averaging.norm_single.weight",
    } <= kept
    assert {name for name in kept if keeps_float32(name)} == {name for name in kept if not name.startswith(BACKBONE)}


# --- precision --------------------------------------------------------------------------------------
def test_float32_conversion_reproduces_every_tensor(source, tmp_path):
    out = convert(str(source), tmp_path / "fold", progress=False, shard_bytes=400_000)
    assert len(weight_files(out)) > 1  # sharded, with its index
    got, want = artifact_tensors(out), source_tensors(source)
    assert got.keys() == want.keys() and all(equal(got[n], want[n]) for n in want)

    config = json.loads((out / "config.json").read_text())
    assert config["dtype"] == "float32" and "quantization" not in config
    expected = FoldConfig.from_dict(json.loads((source / "config.json").read_text())).to_dict()
    assert {k: v for k, v in config.items() if k not in ("dtype", "esmc_mlx")} == expected
    assert FoldConfig.from_dict(config).to_dict() == expected  # reads back as the same model
    assert config["esmc_mlx"]["source"]["files"].keys() == {"model.safetensors"}
    assert all((out / name).is_file() for name in TOKENIZER_FILES[:2])
    assert read_marker(out)["kind"] == "fold"

    again = convert(str(source), out, progress=False, force=True)  # a fold artifact replaces its own kind
    assert read_marker(again)["kind"] == "fold" and no_debris(tmp_path)


def test_bfloat16_keeps_the_strict_set_float32(source, tmp_path):
    out = convert(str(source), tmp_path / "bf16", dtype="bfloat16", progress=False)
    got, want = artifact_tensors(out), source_tensors(source)
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        kept = keeps_float32(name)
        assert equal(got[name], tensor if kept else tensor.astype(mx.bfloat16)), name
    kept = {n for n in got if got[n].dtype == mx.float32}
    assert "confidence_head.boundaries" in kept and "distogram_head.weight" in kept and "parcae.log_delta" in kept
    assert (
        "structure_head.conditioning.fourier.frequencies" in kept
        and "folding_trunk.layers.0.tri_mul_in.norm_mix.bias" in kept
    )
    assert not {n for n in kept if n.startswith(BACKBONE)}  # the backbone: one dtype, as an ESMC's
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"


def test_a_half_checkpoint_converts_in_its_own_dtype(half_source, tmp_path):
    """transformers' bfloat16 checkpoint holds float32 tensors (its strict set, the backbone's
    norms): its dtype is still bfloat16, and the backbone's norms come back to it."""
    want = source_tensors(half_source)
    assert want["esmc.norm.weight"].dtype == mx.float32 and want["distogram_head.weight"].dtype == mx.float32
    out = convert(str(half_source), tmp_path / "own", progress=False)
    got = artifact_tensors(out)
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    for name, tensor in want.items():
        assert equal(got[name], tensor.astype(mx.float32 if keeps_float32(name) else mx.bfloat16)), name


# --- the backbone quantized as an ESMC ----------------------------------------------------------------
def esmc_twin(source: Path, directory: Path) -> Path:
    """An ESMC checkpoint holding the fold's backbone tensors (and a random LM head)."""
    config = FoldConfig.from_dict(json.loads((source / "config.json").read_text())).esmc_config
    state = {n: t for n, t in load_file(source / "model.safetensors").items() if n.startswith(BACKBONE)}
    generator = torch.Generator().manual_seed(0)
    d, v = config.hidden_size, config.vocab_size
    for name, shape in {"dense.weight": (d, d), "dense.bias": (d,), "layer_norm.weight": (d,)}.items():
        state[f"lm_head.{name}"] = torch.randn(shape, generator=generator)
    state.update(
        {
            "lm_head.layer_norm.bias": torch.zeros(d),
            "lm_head.decoder.weight": torch.randn(v, d),
            "lm_head.decoder.bias": torch.zeros(v),
        }
    )
    directory.mkdir()
    save_file(state, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(config.to_dict()))
    return directory


@pytest.mark.parametrize("spec", ["4", "mxfp4", "mixed_3_6"])
def test_quantization_touches_the_backbone_only_and_as_for_an_esmc(spec, source, tmp_path):
    out = convert(str(source), tmp_path / spec, q=spec, dtype="bfloat16", progress=False)
    twin = convert(
        str(esmc_twin(source, tmp_path / "esmc")), tmp_path / f"esmc-{spec}", q=spec, dtype="bfloat16", progress=False
    )
    got, want, esmc = artifact_tensors(out), source_tensors(source), artifact_tensors(twin)
    raw = read_config(out)  # the existing reader: checks the record MLX must run
    record = quantization_record(raw)
    assert record == quantization_record(read_config(twin))  # the ESMC's record, overrides included
    assert raw["quantization_config"] == record

    modules = {n.removesuffix(".scales") for n in got if n.endswith(".scales")}
    blocks = {n.removesuffix(".weight") for n in want if BLOCK_LINEAR.fullmatch(n.removesuffix(".weight"))}
    assert modules == blocks and blocks  # every block projection of the backbone, nothing of the folding model
    for module in modules:
        params = {**record, **record.get(module, {})} if isinstance(record.get(module), dict) else record
        packed = mx.quantize(
            want[f"{module}.weight"].astype(mx.bfloat16),
            group_size=params["group_size"],
            bits=params["bits"],
            mode=params.get("mode", "affine"),
        )
        for part, expected in zip(("weight", "scales", "biases"), packed):
            if expected is not None:
                assert equal(got[f"{module}.{part}"], expected), f"{module}.{part}"
    for name in got:
        if name.startswith(BACKBONE):
            assert equal(got[name], esmc[name]), name  # bit for bit the ESMC's
        else:
            assert equal(got[name], want[name].astype(mx.float32 if keeps_float32(name) else mx.bfloat16)), name
    if spec == "mixed_3_6":  # the recipe's high bits on v and down of the last eighth (of 2 blocks: block 1)
        assert {k for k, v in record.items() if isinstance(v, dict)} == {
            "esmc.layers.1.self_attn.v_proj",
            "esmc.layers.1.mlp.down_proj",
        }

    # the record and the packed tensors rebuild the runtime ESMC's quantized layers
    config = FoldConfig.from_dict(raw).esmc_config
    backbone = ESMC(config)
    weights = {n: t for n, t in got.items() if n.startswith(BACKBONE)}
    apply_quantization(backbone, record, weights)
    weights.update({n: esmc[n] for n in esmc if n.startswith("lm_head.")})
    backbone.load_weights(list(weights.items()), strict=True)


def test_several_precisions_from_one_read(source, tmp_path, monkeypatch):
    reads = []

    def counting(src):
        ckpt = open_checkpoint(src)
        read = ckpt.read
        ckpt.read = lambda name: reads.append(name) or read(name)
        return ckpt

    monkeypatch.setattr("esmc_mlx.convert.open_checkpoint", counting)
    outs = convert_many(str(source), tmp_path / "many", ["4", "mxfp4", None], progress=False)
    assert sorted(reads) == sorted(load_file(source / "model.safetensors"))  # each tensor read once
    assert list(outs) == ["4bit", "mxfp4", "float"]
    assert all(read_marker(d)["kind"] == "fold" for d in outs.values())
    alone = convert(str(source), tmp_path / "alone", q="mxfp4", progress=False)
    many, single = artifact_tensors(outs["mxfp4"]), artifact_tensors(alone)
    assert many.keys() == single.keys() and all(equal(many[n], single[n]) for n in single)
    assert quantization_record(read_config(outs["4bit"]))["bits"] == 4
    assert "quantization" not in read_config(outs["float"])

    requantized = quantize_directory(outs["float"], tmp_path / "requantized", "mxfp4", progress=False)
    again = artifact_tensors(requantized)  # a fold artifact is a fold source: the same names
    assert read_marker(requantized)["kind"] == "fold"
    assert again.keys() == single.keys() and all(equal(again[n], single[n]) for n in single)


# --- refusals -----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "edit,message",
    [
        (
            lambda s: s.pop("structure_head.conditioning.fourier.phases"),
            "missing tensors: structure_head.conditioning.fourier.phases",
        ),
        (lambda s: s.pop("esmc.layers.1.mlp.up_proj.weight"), "missing tensors: esmc.layers.1.mlp.up_proj.weight"),
        (
            lambda s: s.__setitem__("structure_head.extra.weight", torch.zeros(3)),
            "unexpected tensors: structure_head.extra.weight",
        ),
        (lambda s: s.__setitem__("lm_head.decoder.bias", torch.zeros(64)), "unexpected tensors: lm_head.decoder.bias"),
        (
            lambda s: s.__setitem__("confidence_head.boundaries", torch.zeros(5)),
            r"confidence_head.boundaries: shape \(5,\) in the checkpoint, \(127,\) expected",
        ),
    ],
    ids=["a folding tensor missing", "a backbone tensor missing", "an extra tensor", "an LM head", "a wrong shape"],
)
def test_bad_checkpoints_are_refused_before_anything_is_read_or_written(edit, message, source, tmp_path, monkeypatch):
    bad = shutil.copytree(source, tmp_path / "bad")
    state = load_file(bad / "model.safetensors")
    edit(state)
    save_file(state, str(bad / "model.safetensors"))

    def unread(src):
        ckpt = open_checkpoint(src)
        ckpt.read = lambda name: pytest.fail(f"read {name} before the checks")
        return ckpt

    monkeypatch.setattr("esmc_mlx.convert.open_checkpoint", unread)
    out = tmp_path / "out"
    with pytest.raises(ConvertError, match=f"does not match an ESMFold2 model: {message}") as error:
        convert(str(bad), out, progress=False)
    assert "\n" not in str(error.value)  # one problem: one line
    assert not out.exists() and no_debris(tmp_path)


def test_a_damaged_tensor_is_refused_and_nothing_is_left(source, tmp_path):
    bad = shutil.copytree(source, tmp_path / "nan")
    state = load_file(bad / "model.safetensors")
    state["structure_head.token_transformer.layers.1.mlp_gate.weight"][3, 5] = float("nan")
    save_file(state, str(bad / "model.safetensors"))
    with pytest.raises(ConvertError, match="structure_head.token_transformer.layers.1.mlp_gate.weight .* 1 NaN"):
        convert(str(bad), tmp_path / "out", q="4", progress=False)
    assert not (tmp_path / "out").exists() and no_debris(tmp_path)


def test_config_contradicting_the_tensors_names_the_field(source, tmp_path):
    bad = shutil.copytree(source, tmp_path / "cfg")
    config = json.loads((bad / "config.json").read_text())
    config["folding_trunk_num_hidden_layers"] = 1_000_000_000
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        ConvertError,
        match="folding_trunk_num_hidden_layers is 1,000,000,000, but the weights hold 2 blocks of folding_trunk",
    ):
        convert(str(bad), tmp_path / "out", progress=False)
    config["folding_trunk_num_hidden_layers"] = 2
    config["esmc_config"]["num_hidden_layers"] = 3
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        ConvertError, match=r"config.json \(esmc_config\): num_hidden_layers is 3, but the weights hold 2 blocks"
    ):
        convert(str(bad), tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_no_validate_converts_a_fold_without_a_report(source, tmp_path):
    # validating a fold (the default with torch installed): tests/test_fold_validate.py
    result = CliRunner().invoke(convert_main, [str(source), "-o", str(tmp_path / "out"), "--q", "4", "--no-validate"])
    assert result.exit_code == 0, result.output
    assert read_marker(tmp_path / "out")["kind"] == "fold" and not (tmp_path / "out" / "validation").exists()


def test_the_esmc_loader_names_a_fold_artifact(source, tmp_path):
    out = convert(str(source), tmp_path / "fold", progress=False)
    with pytest.raises(ConvertError, match="an ESMFold2 model .*load_fold"):
        load(out)


# --- alias, info, push ----------------------------------------------------------------------------------
def test_alias_resolves_to_the_hub_repo(hub, source, tmp_path):  # noqa: F811
    assert ALIASES["ESMFold2"] == "biohub/ESMFold2" and ALIASES["ESMFold2-Fast"] == "biohub/ESMFold2-Fast"
    hub.state.create_repo("biohub/ESMFold2-Fast")
    hub.state.commit_files("biohub/ESMFold2-Fast", {p.name: p.read_bytes() for p in source.iterdir()}, "add checkpoint")
    out = convert("ESMFold2-Fast", tmp_path / "fast", q="4", progress=False)
    assert read_config(out)["esmc_mlx"]["source"]["id"] == "biohub/ESMFold2-Fast"
    assert default_output("ESMFold2-Fast", "mxfp4", None) == Path("ESMFold2-Fast-mxfp4-mlx")
    help_text = CliRunner().invoke(convert_main, ["--help"]).output
    assert "ESMFold2, ESMFold2-Fast" in help_text


def test_info_describes_both_parts(source, tmp_path):
    from transformers import EsmFold2Model

    out = convert(str(source), tmp_path / "fold-mxfp4", q="mxfp4", dtype="bfloat16", progress=False)
    result = CliRunner().invoke(main, ["info", str(out)])
    assert result.exit_code == 0, result.output
    lines = dict(line.split("  ", 1) for line in result.output.splitlines())
    assert lines["architecture"].strip().startswith("ESMFold2, 2 folding blocks")
    assert "MSA encoder" in lines["architecture"]
    assert lines["folding storage"].strip().startswith("bfloat16 (norms")
    assert lines["backbone storage"].strip().startswith("mxfp4 4-bit, group size 32; 14 layers quantized")
    facts = json.loads(CliRunner().invoke(main, ["info", str(out), "--json"]).output)
    model = EsmFold2Model.from_pretrained(source)
    params = {n: t.numel() for n, t in model.named_parameters()}
    assert facts["folding"]["parameters"] == sum(v for n, v in params.items() if not n.startswith(BACKBONE))
    assert facts["backbone"]["parameters"] == sum(v for n, v in params.items() if n.startswith(BACKBONE))
    assert facts["quantization"] == quantization_record(read_config(out)) and facts["dtype"] == "bfloat16"
    stored = sum(math.prod(t.shape) * t.itemsize for n, t in artifact_tensors(out).items() if n.startswith(BACKBONE))
    assert facts["backbone"]["bits_per_weight"] == round(stored * 8 / facts["backbone"]["parameters"], 3)
    assert facts["size_bytes"] == sum(f.stat().st_size for f in weight_files(out))


def test_push_dry_run_lists_the_fold_files(hub, source, tmp_path):  # noqa: F811
    out = convert(str(source), tmp_path / "fold-4bit", q="4", progress=False)
    (out / "notes.txt").write_text("not part of the artifact")
    result = CliRunner().invoke(main, ["push", str(out), "my-org/ESMFold2-4bit", "--dry-run"])
    assert result.exit_code == 1 and "not validated" in result.output
    result = CliRunner().invoke(main, ["push", str(out), "my-org/ESMFold2-4bit", "--dry-run", "--allow-unvalidated"])
    assert result.exit_code == 0, result.output
    listed = {line.split()[1] for line in result.output.splitlines() if line.startswith("  + ")}
    assert listed == {
        "config.json",
        "model.safetensors",
        "model.safetensors.index.json",
        *TOKENIZER_FILES[:2],
        "README.md",
    }
    card = result.output.split("--- README.md (model card) ---", 1)[1]
    assert "ESMFold2 protein structure model" not in card  # a local source: no base model to name
    assert "esmc-mlx fold my-org/ESMFold2-4bit --sequence" in card and 'load_fold("my-org/ESMFold2-4bit")' in card
    assert "4-bit affine" in card and "library_name: mlx" in card and "esmfold2" in card
    assert "Not validated" in card and "## Validation" in card
    writes = [r for r in hub.state.log if r[0] in ("POST", "PUT", "DELETE") and "validate-yaml" not in r[1]]
    assert not (out / "README.md").exists() and not writes
