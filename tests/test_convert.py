"""Conversion from every input layout, output format, and every bad input of the foundation issue."""

from __future__ import annotations

import json
import shutil

import mlx.core as mx
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="needs torch: pip install -e '.[torch]' in the clone")
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from esmc_mlx import load
from esmc_mlx.cli import convert_main, main
from esmc_mlx.convert import convert
from esmc_mlx.errors import ConvertError

SEQS = ["MKTAYIAKQRQISFVKSHF", "GSHMSLFDKLG", "ACDEFGHIKLMNPQRSTVWY"]


def logits(model_dir, seqs=SEQS):
    model, tok = load(model_dir)
    batch = tok(seqs)
    return np.array(model(batch["input_ids"], attention_mask=batch["attention_mask"]).logits)


def reference_logits(reference_model, seqs=SEQS):
    from esmc_mlx import ESMCTokenizer

    batch = ESMCTokenizer()(seqs, return_tensors="np")
    with torch.no_grad():
        return reference_model(
            input_ids=torch.tensor(batch["input_ids"]).long(),
            attention_mask=torch.tensor(batch["attention_mask"]).long(),
        ).logits.numpy()


def no_leftovers(parent):
    return not [
        p.name for p in parent.iterdir() if ".partial-" in p.name or ".old-" in p.name or p.name.endswith(".lock")
    ]


@pytest.mark.parametrize("layout", ["published", "esm", "legacy"])
def test_every_layout_converts_to_the_same_model(layout, checkpoints, reference_model, tmp_path):
    out = convert(str(checkpoints[layout]), tmp_path / layout, progress=False)
    expected = reference_logits(reference_model)
    got = logits(out)
    assert np.linalg.norm(got - expected) / np.linalg.norm(expected) <= 1e-5
    config = json.loads((out / "config.json").read_text())
    assert config["hidden_size"] == 128 and config["num_hidden_layers"] == 2 and config["dtype"] == "float32"
    files = config["esmc_mlx"]["source"]["files"]
    assert files and all(len(h) == 64 for h in files.values())


def test_output_layout_shards_index_and_tokenizer(checkpoints, reference_model, tmp_path):
    out = convert(str(checkpoints["published"]), tmp_path / "sharded", shard_bytes=100_000, progress=False)
    shards = sorted(out.glob("model-*.safetensors"))
    assert len(shards) > 1 and all(s.stat().st_size < 400_000 for s in shards)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {s.name for s in shards}
    assert np.allclose(logits(out), reference_logits(reference_model), atol=1e-5)
    from transformers import AutoTokenizer, EsmcForMaskedLM

    assert AutoTokenizer.from_pretrained(out)("MKV")["input_ids"] == [0, 20, 15, 7, 2]
    # the output also reads back in transformers (same tensor names)
    back = EsmcForMaskedLM.from_pretrained(out)
    assert torch.equal(back.lm_head.decoder.weight, reference_model.lm_head.decoder.weight)


def test_api_refuses_a_shard_size_that_is_not_positive(checkpoints, tmp_path):
    # convert(..., shard_bytes=0) must not write one shard per tensor (34 files for tiny): the
    # CLI refuses --shard-size 0, and so does the API
    from esmc_mlx.convert.many import convert_many
    from esmc_mlx.pipeline import convert_validate_push

    src = str(checkpoints["published"])
    for bad in (0, -5, 2.5, "1GB"):
        with pytest.raises(ConvertError, match=r"shard_bytes="):
            convert(src, tmp_path / "out", shard_bytes=bad, progress=False)
        with pytest.raises(ConvertError, match=r"shard_bytes="):
            convert_many(src, tmp_path / "many", ["4", "8"], shard_bytes=bad, progress=False)
        with pytest.raises(ConvertError, match=r"shard_bytes="):
            convert_validate_push(src, tmp_path / "pipe", shard_bytes=bad, validate_output=False, log=None)
    assert not list(tmp_path.iterdir())


def test_api_private_without_an_upload_repo_is_refused(checkpoints, tmp_path):
    # convert_validate_push(..., private=True) without upload_repo must not convert and make
    # nothing private without a word (the CLI refuses --private without --upload-repo, 8.4d)
    from esmc_mlx.errors import HubError
    from esmc_mlx.pipeline import convert_validate_push

    with pytest.raises(HubError, match="applies to the repo that upload_repo creates"):
        convert_validate_push(str(checkpoints["published"]), tmp_path / "out", private=True, validate_output=False)
    assert not (tmp_path / "out").exists()


def test_dtype_defaults_to_the_source_and_can_be_chosen(reference_model, tmp_path):
    from esmc_mlx.testing import write_checkpoint

    src = write_checkpoint(reference_model, tmp_path / "bf16src", dtype="bfloat16")
    out = convert(str(src), tmp_path / "a", progress=False)
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert next(iter(mx.load(str(out / "model.safetensors")).values())).dtype == mx.bfloat16
    out16 = convert(str(src), tmp_path / "b", dtype="float16", progress=False)
    assert json.loads((out16 / "config.json").read_text())["dtype"] == "float16"


@pytest.mark.slow  # over 5 s on the 2-core host (--durations=0)
def test_cli_converts_and_info_describes(checkpoints, tmp_path):
    runner = CliRunner()
    result = runner.invoke(convert_main, [str(checkpoints["esm"]), "-o", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    info = runner.invoke(main, ["info", str(tmp_path / "out"), "--json"])
    facts = json.loads(info.output)
    assert facts["parameters"] == sum(
        p.numel()
        for p in torch.nn.Module.parameters(
            __import__("esmc_mlx.testing").testing.random_transformers_model(
                __import__("esmc_mlx.testing").testing.tiny_config()
            )
        )
    )
    assert facts["bits_per_weight"] == pytest.approx(32, abs=0.01)
    size = sum(f.stat().st_size for f in (tmp_path / "out").glob("model*.safetensors"))
    assert facts["size_bytes"] == size and facts["shards"] == 1 and facts["quantization"] is None
    assert facts["architecture"]["layers"] == 2 and isinstance(facts["architecture"]["hidden_size"], int)
    text = runner.invoke(main, ["info", str(tmp_path / "out")]).output
    assert f"parameters       {facts['parameters']:,}" in text and "size on disk" in text
    assert "--q" in runner.invoke(convert_main, ["--help"]).output


def test_info_names_its_size_unit_as_it_counts(tmp_path):
    # `info` divides by 1024, so its units are MiB/GiB: the packaged tiny (20,890,680 bytes, "20.9 MB"
    # in docs/esmc-tiny.md) is 19.92 MiB, the 6B mxfp4 (3.387 GB in docs/quantization.md) 3.15 GiB
    from esmc_mlx.artifact import describe, human_size

    out = convert("tiny", tmp_path / "tiny", progress=False)
    size = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    assert describe(out)["size on disk"] == f"{size / 2**20:.2f} MiB"
    assert (human_size(3_387_000_000), human_size(2048), human_size(10)) == ("3.15 GiB", "2.00 KiB", "10 B")


# --- bad input: clear message, non-zero exit, nothing left in place ---------------------------
def run_cli(args):
    return CliRunner().invoke(convert_main, args)


def test_default_output_names_the_spec_as_the_sub_directories_do(tmp_path, monkeypatch):
    # `esmc-convert tiny --q 4` writes ESMC-tiny-4bit-mlx, as -o DIR --q 4 --q 8 writes DIR/4bit,
    # and --group-size 32 goes to another folder than the default 64
    monkeypatch.chdir(tmp_path)
    for args in (["--q", "4"], ["--q", "4", "--group-size", "32"], ["--q", "mxfp4"], ["--dtype", "float16"]):
        result = CliRunner().invoke(convert_main, ["tiny", "--no-validate", *args])
        assert result.exit_code == 0, result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "ESMC-tiny-4bit-g32-mlx",
        "ESMC-tiny-4bit-mlx",
        "ESMC-tiny-float16-mlx",
        "ESMC-tiny-mxfp4-mlx",
    ]


def test_unknown_alias_and_missing_path(tmp_path):
    for source in ["3B", str(tmp_path / "nowhere"), "./missing.pth"]:
        result = run_cli([source, "-o", str(tmp_path / "out")])
        assert result.exit_code != 0 and "Error:" in result.output and source in result.output
        assert not (tmp_path / "out").exists()


def _edited_copy(src_dir, dst_dir, edit):
    shutil.copytree(src_dir, dst_dir)
    state = load_file(str(dst_dir / "model.safetensors"))
    edit(state)
    save_file(state, str(dst_dir / "model.safetensors"))
    return dst_dir


@pytest.mark.parametrize(
    "edit,message",
    [
        (lambda s: s.pop("esmc.layers.1.mlp.up_proj.weight"), "missing tensors: esmc.layers.1.mlp.up_proj.weight"),
        (
            lambda s: s.__setitem__("esmc.layers.0.extra.weight", torch.zeros(3)),
            "unexpected tensors: esmc.layers.0.extra.weight",
        ),
        (lambda s: s.__setitem__("something_else", torch.zeros(3)), "unexpected tensors: something_else"),
        (
            lambda s: s.__setitem__("esmc.layers.0.self_attn.q_proj.weight", torch.zeros(128, 32)),
            r"esmc.layers.0.self_attn.q_proj.weight: shape \(128, 32\) in the checkpoint, \(128, 128\) expected",
        ),
    ],
)
def test_missing_extra_and_misshaped_tensors(checkpoints, tmp_path, edit, message):
    bad = _edited_copy(checkpoints["published"], tmp_path / "bad", edit)
    with pytest.raises(ConvertError, match=message):
        convert(str(bad), tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists() and no_leftovers(tmp_path)


def test_truncated_and_corrupt_safetensors(checkpoints, tmp_path):
    bad = shutil.copytree(checkpoints["published"], tmp_path / "trunc")
    data = (bad / "model.safetensors").read_bytes()
    (bad / "model.safetensors").write_bytes(data[: len(data) - 1000])
    result = run_cli([str(bad), "-o", str(tmp_path / "out")])
    assert result.exit_code == 1 and "truncated or corrupt" in result.output and "model.safetensors" in result.output
    (bad / "model.safetensors").write_bytes(b"\xff" * 64)
    result = run_cli([str(bad), "-o", str(tmp_path / "out")])
    assert result.exit_code == 1 and "not a readable safetensors file" in result.output
    assert not (tmp_path / "out").exists() and no_leftovers(tmp_path)


def test_corrupt_pth(tmp_path):
    (tmp_path / "broken.pth").write_bytes(b"not a pickle at all")
    result = run_cli([str(tmp_path / "broken.pth"), "-o", str(tmp_path / "out")])
    assert result.exit_code == 1 and "broken.pth" in result.output and "cannot read" in result.output


def test_config_contradicting_shapes(checkpoints, tmp_path):
    bad = shutil.copytree(checkpoints["published"], tmp_path / "cfg")
    config = json.loads((bad / "config.json").read_text())
    config["intermediate_size"] = 768
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        ConvertError,
        match=r"config.json: intermediate_size is 768, but esmc.layers.0.mlp.up_proj.weight has shape \[512, 128\]",
    ):
        convert(str(bad), tmp_path / "out", progress=False)
    config["num_attention_heads"] = 3  # 128 is not a multiple of 3
    config.pop("head_dim"), config.pop("num_key_value_heads")
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConvertError, match="not a multiple of num_attention_heads"):
        convert(str(bad), tmp_path / "out", progress=False)


@pytest.mark.slow  # over 5 s on the 2-core host (--durations=0)
def test_existing_output_needs_force_and_is_kept_on_failure(checkpoints, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "precious.txt").write_text("keep me")
    result = run_cli([str(checkpoints["published"]), "-o", str(out)])
    assert result.exit_code == 1 and "already exists" in result.output and "--force" in result.output
    # a failing forced conversion leaves the old output untouched
    result = run_cli(["./missing", "-o", str(out), "--force"])
    assert result.exit_code == 1 and (out / "precious.txt").read_text() == "keep me"
    # docs/reliability.md, rule 1: --force replaces only what esmc-mlx wrote, never a user's directory
    result = run_cli([str(checkpoints["published"]), "-o", str(out), "--force"])
    assert result.exit_code == 1 and "esmc-mlx did not write it" in result.output
    assert (out / "precious.txt").read_text() == "keep me" and not (out / "config.json").exists()
    out = tmp_path / "ours"
    assert run_cli([str(checkpoints["published"]), "-o", str(out)]).exit_code == 0
    result = run_cli([str(checkpoints["published"]), "-o", str(out), "--force"])
    assert result.exit_code == 0 and (out / "config.json").exists()
    assert no_leftovers(tmp_path)


def test_unwritable_output_path(checkpoints, tmp_path):
    (tmp_path / "a_file").write_text("")
    result = run_cli([str(checkpoints["published"]), "-o", str(tmp_path / "a_file" / "out")])
    assert result.exit_code == 1 and "cannot create" in result.output and "a_file" in result.output


def test_bad_dtype_option(checkpoints, tmp_path):
    result = run_cli([str(checkpoints["published"]), "-o", str(tmp_path / "o"), "--dtype", "int8"])
    assert result.exit_code == 2 and "--dtype" in result.output
