"""Inputs read as they are, bounded before anything is built, and one `Error:` line for each way
they can be wrong (esmc_mlx/readers.py, artifact.py, config.py): FASTA and CSV lines end at \\n
and \\r only; safetensors offsets that overlap, leave a gap or run backwards are refused; config
values are checked against the weights' headers and the machine's memory; nested or malformed
JSON, huge numbers and quantization records MLX cannot run are one line naming the file and the
field. Each case asserts the exit code, the message and the disk afterwards."""

from __future__ import annotations

import gzip
import io
import json
import re
import shutil
import struct
import time
from pathlib import Path

import numpy as np
import pytest
from fault_tools import cli, convert_cli, debris, one_error_line, rewrite_header, snapshot

import esmc_mlx
from esmc_mlx import readers
from esmc_mlx.convert import convert
from esmc_mlx.errors import ConvertError, FastaError, JobError
from esmc_mlx.tasks import scoring
from esmc_mlx.tasks.fasta import parse_fasta, read_fasta
from esmc_mlx.tasks.jobs import read_mutants_csv

SEQ = "MKTAYIAKQRQ"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return convert("tiny", tmp_path_factory.mktemp("tiny") / "model", progress=False)


@pytest.fixture
def copy(model, tmp_path):
    """A copy of the model to damage."""
    return Path(shutil.copytree(model, tmp_path / "copy"))


# --- rule 6: lines end at \n and \r only; bytes are read as they are ----------------------------------
@pytest.mark.parametrize(
    "description",
    [b"Hemoglobin \x85 alpha", "Hemoglobin \u2028 alpha".encode(), "x \u0085 y \u2029 z \x0c".encode(), b"a\x1cb\x1dc"],
    ids=["cp1252-ellipsis", "U+2028", "U+0085-U+2029-FF", "file-separators"],
)
def test_a_description_holding_a_unicode_line_break_stays_one_line(tmp_path, description):
    path = tmp_path / "in.fa"
    path.write_bytes(b">P1 " + description + b"\nMKTAYIAKQRQ\n>P2\r\nMVLS\rPADK\r\n")
    records = read_fasta(path)
    assert [(r.id, r.sequence) for r in records] == [("P1", SEQ), ("P2", "MVLSPADK")]
    assert records[0].description.startswith("Hemoglobin") or len(records[0].description) > 3
    text = path.read_bytes().decode("utf-8", errors="replace")
    assert [r.sequence for r in parse_fasta(text)] == [SEQ, "MVLSPADK"]
    with gzip.open(tmp_path / "in.fa.gz", "wb") as f:
        f.write(path.read_bytes())
    assert [r.sequence for r in read_fasta(tmp_path / "in.fa.gz")] == [SEQ, "MVLSPADK"]


@pytest.mark.parametrize("junk", ["\u2028", "\u00a0", "\u0085"])
def test_a_unicode_space_inside_a_sequence_is_an_error_naming_it(tmp_path, junk):
    path = tmp_path / "in.fa"
    path.write_text(f">P1\nMKTA{junk}YIAK\n", encoding="utf-8")
    with pytest.raises(FastaError, match=re.escape(f"invalid character {junk!r}")):
        read_fasta(path)


def test_line_endings_split_across_read_chunks(tmp_path, monkeypatch):
    monkeypatch.setattr(readers, "CHUNK", 7)  # a CR at a chunk's end waits for its LF
    text = b"\xef\xbb\xbf>a desc\r\nMKTA\r\nYIAK\r>b\rMVLS\n\n>c\r\n\r\nPADK"
    stream = io.BytesIO(text)
    lines = list(readers.text_lines(stream, "x", FastaError))
    assert lines == [">a desc", "MKTA", "YIAK", ">b", "MVLS", "", ">c", "", "PADK"]
    (tmp_path / "in.fa").write_bytes(text)
    assert [(r.id, r.sequence) for r in read_fasta(tmp_path / "in.fa")] == [
        ("a", "MKTAYIAK"),
        ("b", "MVLS"),
        ("c", "PADK"),
    ]
    with pytest.raises(FastaError, match="a binary file"):
        list(readers.text_lines(io.BytesIO(b">a\nMK\x00T\n"), "x", FastaError))


def test_a_csv_read_as_it_is(model, tmp_path):
    path = tmp_path / "dms.csv"
    rows = [
        b"\xef\xbb\xbfmutant,DMS_score,note\r\n",
        b"M1A,0.5,caf\xe9 \x85 pasted from Excel\r\n",
        "K2P,0.1,one \u2028 line\r\n".encode(),
        b'T3A,0.2,"a quoted\r\nnote on two lines"\r\n',
        b"Y5W,0.3,plain\r",
    ]
    path.write_bytes(b"".join(rows))
    columns, parsed, where = read_mutants_csv(path)
    assert columns == ["mutant", "DMS_score", "note"] and [r["mutant"] for r in parsed] == ["M1A", "K2P", "T3A", "Y5W"]
    assert parsed[1]["note"] == "one \u2028 line" and parsed[0]["note"].startswith("caf\u00e9")
    assert where[3].endswith("line 6: ")  # the quoted field's two lines counted
    out = tmp_path / "scored.csv"
    result = cli("score", model, "--sequence", SEQ, "--mutations", path, "-o", out, "--no-progress")
    assert result.exit_code == 0, result.output
    assert len(list(read_mutants_csv(out)[1])) == 4
    path.write_bytes(b"mutant\nM1A\n\x00\x01binary")
    with pytest.raises(JobError, match="a binary file"):
        read_mutants_csv(path)


# --- rule 6: safetensors offsets as the safetensors library reads them --------------------------------
Q, K = "esmc.layers.0.self_attn.q_proj.weight", "esmc.layers.0.self_attn.k_proj.weight"


def overlap(h):
    h[K]["data_offsets"] = list(h[Q]["data_offsets"])


def swap(h):  # both tensors' bytes read from the other's place: consistent sizes, no gap
    h[Q]["data_offsets"], h[K]["data_offsets"] = h[K]["data_offsets"], h[Q]["data_offsets"]


def gap(h):  # everything after K 8 bytes on: 8 bytes that belong to no tensor
    end = h[K]["data_offsets"][1]
    for name, t in h.items():
        if name != "__metadata__" and t["data_offsets"][0] >= end:
            t["data_offsets"] = [t["data_offsets"][0] + 8, t["data_offsets"][1] + 8]


@pytest.mark.parametrize("edit,message", [(overlap, "overlaps tensor"), (gap, "unused")], ids=["overlap", "gap"])
def test_tensors_whose_bytes_overlap_or_leave_a_gap_are_refused(copy, tmp_path, edit, message):
    rewrite_header(copy / "model.safetensors", edit)
    if edit is gap:  # the file grows by the 8 bytes the header now skips: only the gap is wrong
        with open(copy / "model.safetensors", "ab") as f:
            f.write(b"\0" * 8)
    before = snapshot(copy)
    one_error_line(convert_cli(copy, "-o", tmp_path / "out", "--no-validate"), "model.safetensors", message)
    one_error_line(cli("info", copy), message)
    with pytest.raises(ConvertError, match=message):
        esmc_mlx.load(copy)
    assert snapshot(copy) == before and not (tmp_path / "out").exists() and debris(tmp_path) == []


def test_tensors_that_swap_places_read_as_the_library_reads_them(copy, tmp_path):
    """Offsets out of the names' order but contiguous are valid safetensors: the library reads
    them; so does esmc-mlx, the same bytes under the same names."""
    from safetensors.numpy import load_file

    rewrite_header(copy / "model.safetensors", swap)
    want = load_file(str(copy / "model.safetensors"))
    out = convert(str(copy), tmp_path / "out", progress=False)
    got = load_file(str(out / "model.safetensors"))
    np.testing.assert_array_equal(got[Q], want[Q])


# --- rule 7: bounded before anything is built ----------------------------------------------------------
@pytest.mark.parametrize(
    "field,value,message",
    [
        ("num_hidden_layers", 10**9, "num_hidden_layers is 1,000,000,000, but the weights hold 6 blocks"),
        ("num_hidden_layers", 1e9, "num_hidden_layers is 1,000,000,000"),
        ("num_hidden_layers", 7, "num_hidden_layers is 7, but the weights hold 6 blocks"),
        ("hidden_size", 2**40, "hidden_size 1099511627776"),  # head_dim x heads says so first
        ("head_dim", None, "hidden_size is 1,099,511,627,776, but esmc.norm.weight has shape [256]"),
        ("vocab_size", 1, "vocab_size must be at least the tokenizer's 33 tokens"),
        ("intermediate_size", 10**12, "intermediate_size is 1,000,000,000,000"),
    ],
)
def test_config_values_are_bounded_by_the_weights(copy, tmp_path, field, value, message):
    config = json.loads((copy / "config.json").read_text())
    if field == "head_dim":  # without it, the weights' shapes are what contradicts hidden_size
        del config["head_dim"]
        field, value = "hidden_size", 2**40
    config[field] = value
    (copy / "config.json").write_text(json.dumps(config))
    fasta = tmp_path / "in.fa"
    fasta.write_text(f">a\n{SEQ}\n")
    started = time.monotonic()
    for result in (
        cli("info", copy),
        cli("embed", copy, fasta, "-o", tmp_path / "emb"),
        convert_cli(copy, "-o", tmp_path / "out", "--no-validate"),
    ):
        one_error_line(result, "config.json", message)
    with pytest.raises(ConvertError, match=message.split(",")[0]):
        esmc_mlx.load(copy)
    assert time.monotonic() - started < 30  # nothing was built for a billion layers
    assert not (tmp_path / "emb").exists() and not (tmp_path / "out").exists() and debris(tmp_path) == []


def test_a_tensor_numbered_far_past_the_blocks(copy, tmp_path):
    def far(h):
        h["esmc.layers.999999999.input_layernorm.weight"] = h.pop("esmc.layers.1.input_layernorm.weight")

    rewrite_header(copy / "model.safetensors", far)
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps(dict(config, num_hidden_layers=10**9)))
    line = one_error_line(convert_cli(copy, "-o", tmp_path / "out", "--no-validate"), "blocks numbered 0, 1, 2")
    assert "999999999" in line and "config.json" in line
    one_error_line(cli("info", copy), "blocks numbered")
    assert not (tmp_path / "out").exists() and debris(tmp_path) == []


@pytest.fixture
def little_memory(monkeypatch):
    """A machine of 1 GiB (what a forward may use), whatever this one has."""
    monkeypatch.setattr(scoring, "memory_bytes", lambda: 1 << 30)


def test_a_record_too_long_for_memory_is_one_error_naming_it(model, tmp_path, little_memory):
    fasta = tmp_path / "long.fa"
    fasta.write_text(f">short\n{SEQ}\n>giant desc\n{'MKTAYIAKQR' * 200_000}\n")
    emb = tmp_path / "emb"
    line = one_error_line(
        cli("embed", model, fasta, "-o", emb, "--no-progress"), "record 'giant'", "2,000,000 residues"
    )
    assert "split the record" in line and "GiB" in line
    assert not emb.exists() and debris(tmp_path) == []


@pytest.mark.slow  # reads a 50 MB FASTA twice: over 5 s on the 2-core host
def test_a_fifty_million_residue_record(model, tmp_path):
    fasta = tmp_path / "huge.fa"
    with open(fasta, "w") as f:
        f.write(">huge\n")
        for _ in range(500):
            f.write("MKTAYIAKQR" * 10_000 + "\n")
    one_error_line(cli("embed", model, fasta, "-o", tmp_path / "emb", "--no-progress"), "record 'huge'", "50,000,000")
    assert not (tmp_path / "emb").exists() and debris(tmp_path) == []


def test_batch_tokens_past_memory(model, tmp_path):
    fasta = tmp_path / "in.fa"
    fasta.write_text(f">a\n{SEQ}\n>b\n{SEQ * 3}\n")
    emb = tmp_path / "emb"
    result = cli("embed", model, fasta, "-o", emb, "--batch-tokens", "1000000000000", "--no-progress")
    one_error_line(result, "--batch-tokens 1,000,000,000,000", "give a smaller --batch-tokens")
    assert not emb.exists() and debris(tmp_path) == []


def test_a_scan_past_memory_says_how_to_run_it(model, tmp_path, little_memory):
    long = "MKTAYIAKQR" * 3000
    out = tmp_path / "scan"
    result = cli("scan", model, "--sequence", long, "-o", out, "--window", "0", "--no-plot", "--no-progress")
    one_error_line(result, "30,000 residues", "--window")
    assert not out.exists() and debris(tmp_path) == []


# --- rule 8: one Error line naming the file and the field ----------------------------------------------
def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


@pytest.mark.parametrize("where", ["config.json", "model.safetensors.index.json", "header"])
def test_deeply_nested_json_is_one_line_naming_the_file(copy, tmp_path, where):
    if where == "header":
        data = (copy / "model.safetensors").read_bytes()
        n = int.from_bytes(data[:8], "little")
        raw = b'{"deep": ' + nested(100_000).encode() + b"}"
        raw += b" " * (-len(raw) % 8)
        (copy / "model.safetensors").write_bytes(len(raw).to_bytes(8, "little") + raw + data[8 + n :])
        name = "model.safetensors"
    else:
        (copy / where).write_text('{"a": ' + nested(100_000) + "}")
        name = where
    line = one_error_line(cli("info", copy), name, "nested")
    assert "RecursionError" not in line
    one_error_line(convert_cli(copy, "-o", tmp_path / "out", "--no-validate"), name, "nested")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "value,message",
    [
        ('"abc"', "residue_scaling_base must be a number, got 'abc'"),
        ("1" * 5000, "not valid JSON"),  # Python builds no int of 5,000 digits
        ("1e999", "residue_scaling_base must be a number, got inf"),
        ("[36]", "residue_scaling_base must be a number"),
    ],
)
def test_config_values_that_are_not_numbers_name_the_file_and_field(copy, tmp_path, value, message):
    text = (copy / "config.json").read_text().rstrip().rstrip("}") + f', "residue_scaling_base": {value}}}'
    (copy / "config.json").write_text(text)
    one_error_line(cli("info", copy), str(copy / "config.json"), message)
    one_error_line(convert_cli(copy, "-o", tmp_path / "out", "--no-validate"), "config.json", message)


def test_a_config_that_is_not_utf8_names_the_file(copy, tmp_path):
    (copy / "config.json").write_bytes(b'{"hidden_size": 128, "note": "caf\xe9"}')
    line = one_error_line(cli("info", copy), str(copy / "config.json"), "not UTF-8")
    assert line.count(str(copy)) == 1
    one_error_line(convert_cli(copy, "-o", tmp_path / "out", "--no-validate"), str(copy / "config.json"), "not UTF-8")
    (copy / "config.json").write_bytes(b" " * (2 << 20))  # larger than any config
    one_error_line(cli("info", copy), "larger than")


@pytest.mark.parametrize(
    "change,message",
    [
        ({"group_size": 2**32}, "group_size 4294967296 is not a quantization MLX runs"),
        ({"bits": 0}, "needs positive integers bits and group_size"),
        ({"mode": "bogus"}, "mode 'bogus' is not one of affine, mxfp4, mxfp8, nvfp4"),
        ({"esmc.layers.0.mlp.up_proj": {"bits": 7}}, "entry 'esmc.layers.0.mlp.up_proj': affine with bits 7"),
    ],
)
def test_quantization_records_mlx_cannot_run(tmp_path, change, message):
    out = convert("tiny", tmp_path / "q4", q="4", progress=False)
    config = json.loads((out / "config.json").read_text())
    for key in ("quantization", "quantization_config"):
        config[key].update(change)
    (out / "config.json").write_text(json.dumps(config))
    before = snapshot(out)
    for result in (cli("info", out), cli("quantize", out, "-o", tmp_path / "again", "--q", "8")):
        one_error_line(result, "config.json", message)
    with pytest.raises(ConvertError, match=message.split(" is")[0].split(":")[0]):
        esmc_mlx.load(out)
    assert snapshot(out) == before and not (tmp_path / "again").exists()


@pytest.mark.parametrize("change", [{"bits": 0}, {"mode": "bogus"}, {"group_size": 2**32}])
def test_an_mlx_lm_quantized_source_with_a_bad_record(reference_model, tmp_path, change):
    from esmc_mlx.testing import write_mlx_lm_checkpoint

    src = write_mlx_lm_checkpoint(reference_model, tmp_path / "q8", bits=8)
    config = json.loads((src / "config.json").read_text())
    for key in ("quantization", "quantization_config"):
        if key in config:
            config[key].update(change)
    (src / "config.json").write_text(json.dumps(config))
    one_error_line(convert_cli(src, "-o", tmp_path / "out", "--no-validate"), str(src / "config.json"), "quantization")
    assert not (tmp_path / "out").exists() and debris(tmp_path) == []


def test_a_mutation_position_of_five_thousand_digits(model, tmp_path):
    csv_in = tmp_path / "m.csv"
    csv_in.write_text(f"mutant\nM1A\nM{'1' * 5000}A\n")
    before = snapshot(csv_in)
    line = one_error_line(
        cli("score", model, "--sequence", SEQ, "--mutations", csv_in, "-o", tmp_path / "s.csv"),
        f"{csv_in}, line 3",
        "(5,000 digits) is out of range",
    )
    assert (
        "1" * 100 not in line and snapshot(csv_in) == before
    )  # the number is not echoed whole and not (tmp_path / "s.csv").exists()


@pytest.mark.parametrize("form", ["raw pickle", "zip"])
def test_a_pth_with_a_pickle_payload_says_what_it_is(tmp_path, form):
    torch = pytest.importorskip("torch", reason="reading a .pth needs torch")
    import os
    import pickle

    class Payload:
        def __reduce__(self):
            return (os.system, ("true",))

    path = tmp_path / "model.pth"
    if form == "raw pickle":
        path.write_bytes(pickle.dumps({"embed.weight": Payload()}))
    else:
        torch.save({"embed.weight": torch.zeros(2), "x": Payload()}, path)
    line = one_error_line(convert_cli(path, "-o", tmp_path / "out", "--no-validate"), "holds Python objects")
    assert "weights_only" not in line and "trust" not in line
    assert not (tmp_path / "out").exists()


def test_readers_bound_what_they_read(tmp_path):
    assert readers.json_depth(b'{"a": "[[[[[[", "b": [[1]]}') == 3  # brackets in strings do not count
    (tmp_path / "x.json").write_bytes(b"[" * 65 + b"]" * 65)
    with pytest.raises(ConvertError, match="nested 65 levels deep"):
        readers.read_json(tmp_path / "x.json", ConvertError)
    (tmp_path / "x.json").write_bytes(b'{"a": 1}')
    with pytest.raises(ConvertError, match="larger than 4 bytes"):
        readers.read_json(tmp_path / "x.json", ConvertError, max_bytes=4)
    header = struct.pack("<Q", 2**62)
    (tmp_path / "h.safetensors").write_bytes(header + b"{}")
    from esmc_mlx.artifact import safetensors_header

    with pytest.raises(ConvertError, match="header length of 4,611,686,018,427,387,904 bytes"):
        safetensors_header(tmp_path / "h.safetensors")
