"""Three rules of docs/reliability.md on every command they concern, and a returning user's API:

5. What the user owns is replaced only with --force: every file output (score's CSV and its
   .rejected.csv, predict's CSV) and bench's folder go through the output guard; a file esmc-mlx
   did not write, or that was edited since, is refused without --force.
6. Inputs are read as what they are: one --sequence rule for score, scan, features, attention and
   predict (a file name is never a protein); DNA or RNA is refused wherever a sequence is read.
7. Messages name what the user can act on: a full disk names the output's file (never a staging
   folder); Ctrl-C says what each output keeps and that the same command resumes.

Each CLI case asserts the exit code, the one `Error:` line (or the one `Stopped` line) and the disk
afterwards: digests of the user's files before and after, no debris. The model is the packaged
esmc-tiny, converted here; no torch needed."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
from fault_tools import cli, debris, one_error_line, snapshot, visible

from esmc_mlx import load_sae, outputs, read_embeddings
from esmc_mlx.errors import JobError, ScoringError, SequenceError
from esmc_mlx.resolve import PACKAGED
from esmc_mlx.tasks.fasta import looks_like_path, read_sequence_option
from esmc_mlx.vocab import check_sequence, nucleotide_share

WT = "MKTAYIAKQRQISFVKSHFSRQ"
DNA = "ATGGCTAGCTTGACCGGTAAACTGCTGAGCGATCCG"


@pytest.fixture
def work(tmp_path, monkeypatch):
    """A folder to run in, with a mutants CSV, and esmc-mlx's cache (where it remembers the
    files it wrote) inside it."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("ESMC_MLX_CACHE", str(tmp_path / ".cache"))
    from esmc_mlx import settings

    settings.reload()
    (tmp_path / "dms.csv").write_text("mutant\nK2A\nT3G\n")
    return tmp_path


def score(model, *extra):
    return cli("score", model, "--sequence", WT, "--mutations", "dms.csv", "--no-progress", *extra)


def users_file(path: Path, text: str = "my notes\n") -> dict:
    path.write_text(text)
    return snapshot(path)


# --- rule 5: a file the user owns ---------------------------------------------------------------------
def test_score_never_replaces_a_users_csv_without_force(model, work):
    before = users_file(work / "notes.csv")
    one_error_line(score(model, "-o", "notes.csv"), "-o notes.csv", "esmc-mlx did not write it", "--force")
    assert snapshot(work / "notes.csv") == before and debris(work) == []
    # the default output beside the mutations, when the user already has a file of that name
    mine = users_file(work / "dms.scored.csv")
    one_error_line(score(model), "dms.scored.csv", "esmc-mlx did not write it")
    assert snapshot(work / "dms.scored.csv") == mine and debris(work) == []
    # --force replaces it, whole
    result = score(model, "-o", "notes.csv", "--force")
    assert result.exit_code == 0, result.output
    assert (work / "notes.csv").read_text().startswith("mutant,masked_marginal,wt_marginal")
    assert debris(work) == [] and visible(work) == ["dms.csv", "dms.scored.csv", "notes.csv"]


def test_score_replaces_what_it_wrote_and_not_what_was_edited_since(model, work):
    assert score(model, "-o", "out.csv").exit_code == 0
    assert score(model, "-o", "out.csv").exit_code == 0  # a rerun: its own file
    with open(work / "out.csv", "a") as f:
        f.write("K9A,1,2\n")  # the user edited it: theirs now
    before = snapshot(work / "out.csv")
    one_error_line(score(model, "-o", "out.csv"), "out.csv", "or it was changed since")
    assert snapshot(work / "out.csv") == before and debris(work) == []


def test_score_rejects_file_is_guarded_too(model, work):
    (work / "dms.csv").write_text("mutant\nK2A\nQ3G\n")  # Q3G: the wild type has T at 3
    mine = users_file(work / "out.rejected.csv")
    one_error_line(score(model, "-o", "out.csv", "--skip-invalid"), "out.rejected.csv", "did not write it")
    assert snapshot(work / "out.rejected.csv") == mine and not (work / "out.csv").exists() and debris(work) == []
    result = score(model, "-o", "out.csv", "--skip-invalid", "--force")
    assert result.exit_code == 0, result.output
    assert "Q3G" in (work / "out.rejected.csv").read_text() and debris(work) == []


def test_a_link_to_a_users_file_is_refused_and_with_force_its_file_replaced(model, work):
    before = users_file(work / "target.csv")
    (work / "link.csv").symlink_to("target.csv")
    one_error_line(score(model, "-o", "link.csv"), "link.csv", "did not write it")
    assert snapshot(work / "target.csv") == before
    assert score(model, "-o", "link.csv", "--force").exit_code == 0
    assert (work / "link.csv").is_symlink() and (work / "target.csv").read_text().startswith("mutant,")


def test_with_the_cache_off_a_rerun_needs_force_and_says_why(model, work, monkeypatch):
    from esmc_mlx import settings

    assert score(model, "-o", "out.csv").exit_code == 0
    monkeypatch.setenv("ESMC_MLX_CACHE", "off")
    settings.reload()
    before = snapshot(work / "out.csv")
    one_error_line(score(model, "-o", "out.csv"), "ESMC_MLX_CACHE=off", "--force")
    assert snapshot(work / "out.csv") == before
    assert score(model, "-o", "out.csv", "--force").exit_code == 0
    assert score(model, "-o", "/dev/null").exit_code == 0  # a device is written in place, never replaced


def test_the_ledger_of_written_files_survives_damage(work):
    ledger = work / ".cache" / outputs.WRITTEN
    ledger.parent.mkdir()
    for damaged in ("[]", "{", '{"x": 5}', "\xff"):
        ledger.write_text(damaged)
        path = work / "f.csv"
        path.write_text("a\n")
        assert not outputs.wrote(path)
        outputs.remember_written(path)
        assert outputs.wrote(path)
        path.write_text("b\n")  # same size, other bytes: not what esmc-mlx wrote
        assert not outputs.wrote(path)


@pytest.mark.skipif(importlib.util.find_spec("mlx_lm") is None, reason="fine-tuning needs the finetune extra")
def test_predict_never_replaces_a_users_csv_without_force(model, work):
    rng = np.random.default_rng(0)
    rows = ["".join(rng.choice(list("ACDEFGHIKLMNPQRSTVWY"), 12)) for _ in range(6)]
    (work / "train.csv").write_text("sequence,label\n" + "".join(f"{s},{'ab'[i % 2]}\n" for i, s in enumerate(rows)))
    trained = cli("finetune", model, "--train", "train.csv", "-o", "adapter", "--epochs", "1", "--no-progress")
    assert trained.exit_code == 0, trained.output
    card = (work / "adapter" / "README.md").read_text()
    assert "pypi.org" not in card and "not published on PyPI" in card  # no link to a page that does not exist
    mine = users_file(work / "notes.csv")
    one_error_line(cli("predict", "adapter", "--sequence", WT, "-o", "notes.csv"), "notes.csv", "did not write it")
    assert snapshot(work / "notes.csv") == mine and debris(work) == []
    assert cli("predict", "adapter", "--sequence", WT, "-o", "notes.csv", "--force").exit_code == 0
    assert (work / "notes.csv").read_text().startswith("id,sequence,prediction")
    assert cli("predict", "adapter", "--csv", "train.csv", "-o", "notes.csv").exit_code == 0  # its own now
    assert debris(work) == []


def test_bench_writes_only_into_a_folder_it_may(work):
    mine = work / "results"
    mine.mkdir()
    before = users_file(mine / "bench.json", "{}")
    one_error_line(cli("bench", "--model", "tiny", "--no-torch", "-o", mine), "results", "esmc-mlx did not make")
    assert snapshot(mine / "bench.json") == before and debris(work, mine) == []


# --- rule 6: --sequence is read as what it is -------------------------------------------------------
COMMANDS = {
    "score": lambda m, sae, s: ["score", m, "--sequence", s, "--mutations", "dms.csv", "-o", "o.csv", "--no-progress"],
    "scan": lambda m, sae, s: ["scan", m, "--sequence", s, "-o", "scan", "--no-plot", "--no-progress"],
    "features": lambda m, sae, s: [
        "features",
        m,
        "--sae",
        sae,
        "--layer",
        "1",
        "--sequence",
        s,
        "-o",
        "f",
        "--no-progress",
    ],
    "attention": lambda m, sae, s: ["attention", m, "--sequence", s, "-o", "attn", "--no-plot", "--no-progress"],
    "predict": lambda m, sae, s: ["predict", "no-adapter-needed", "--sequence", s, "-o", "p.csv"],
}


@pytest.mark.parametrize("command", sorted(COMMANDS))
@pytest.mark.parametrize("value", ["try.fsta", "try3.fsta", "wt.fa.gz", "sub/wt", "~/no-such.fasta", "MKT.AYI"])
def test_a_file_name_is_never_read_as_a_protein(model, sae, work, command, value):
    before = snapshot(work)
    result = cli(*COMMANDS[command](model, sae, value))
    one_error_line(result, f"--sequence {value}: no such file")
    assert snapshot(work) == before and debris(work) == []


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_a_folder_or_dna_as_sequence_is_refused_by_every_command(model, sae, work, command):
    (work / "folder").mkdir()
    before = snapshot(work)
    one_error_line(cli(*COMMANDS[command](model, sae, "folder")), "a folder, not a FASTA file")
    one_error_line(cli(*COMMANDS[command](model, sae, DNA)), "reads as DNA or RNA")
    assert snapshot(work) == before and visible(work) == ["dms.csv", "folder"]
    (work / "dna.fa").write_text(f">gene\n{DNA.lower()}\n")
    before = snapshot(work)
    one_error_line(cli(*COMMANDS[command](model, sae, "dna.fa")), "dna.fa", "'gene'", "DNA or RNA")
    assert snapshot(work) == before and debris(work) == []


def test_an_existing_fasta_is_read_by_every_command(model, sae, work):
    (work / "wt.fa").write_text(f">P1 a protein\n{WT}\n")
    result = cli("scan", model, "--sequence", "wt.fa", "-o", "scan", "--no-plot", "--no-progress")
    assert result.exit_code == 0, result.output
    assert (work / "scan" / "P1_scan.csv").is_file()
    assert read_sequence_option("wt.fa") == ("P1", WT)
    (work / "two.fa").write_text(f">a\n{WT}\n>b\n{WT}\n")
    with pytest.raises(SequenceError, match="holds 2 records; --sequence takes a file of one"):
        read_sequence_option("two.fa")


def test_dna_fasta_is_refused_by_embed_and_scan(model, work):
    (work / "dna.fa").write_text(f">p\n{WT}\n>gene2\n{DNA}\n")
    before = snapshot(work)
    one_error_line(cli("embed", model, "dna.fa", "-o", "emb", "--no-progress"), "record 'gene2'", "DNA or RNA")
    one_error_line(cli("scan", model, "--fasta", "dna.fa", "-o", "s", "--no-progress"), "'gene2'", "translate it")
    assert snapshot(work) == before and debris(work) == [] and visible(work) == ["dms.csv", "dna.fa"]


@pytest.mark.parametrize(
    "text, path",
    [
        ("try.fsta", True),
        ("try3.fsta", True),
        ("wt.FA", True),
        ("a/b", True),
        ("~x", True),
        ("MKTAYI", False),
        ("MKT-AYI", False),
        ("MKT..", False),
        ("...", False),
        ("MK|TAY", False),
    ],
)
def test_looks_like_path(text, path):
    assert looks_like_path(text) is path


@pytest.mark.parametrize(
    "sequence, dna",
    [
        (DNA, True),
        (DNA.replace("T", "U"), True),  # RNA
        ("ACGTNNACGTRYACGTACGTACGTACGT", True),  # an ambiguity code or two
        ("ACGTACGTAC", False),  # too short to tell: a peptide may be so
        ("A" * 40, False),  # poly-alanine
        ("GAGAGAGAGAGAGAGAGAGAGAGA", False),  # silk-like repeat: two of the bases
        ("N" * 30 + "Q", False),  # a poly-N tract
        (WT, False),
    ],
)
def test_nucleotide_share(sequence, dna):
    assert (nucleotide_share(sequence) is not None) is dna
    if dna:
        with pytest.raises(SequenceError, match="reads as DNA or RNA"):
            check_sequence(sequence, "x")
    else:
        assert check_sequence(sequence) == sequence


# --- rule 7: messages ----------------------------------------------------------------------------------
def test_a_full_disk_under_quantize_sae_names_the_outputs_file(sae, work, monkeypatch):
    import collections

    import esmc_mlx.convert.sae as sae_writer

    def full(path, *args, **kwargs):
        raise RuntimeError("[write] Unable to write 4096 bytes")

    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(sae_writer.mx, "save_safetensors", full)
    monkeypatch.setattr(outputs.shutil, "disk_usage", lambda path: usage(1 << 30, 1 << 30, 0))
    line = one_error_line(
        cli("quantize-sae", sae, "-o", "q8", "--q", "8", "--no-validate"), "the disk is full", "q8/layer_1.safetensors"
    )
    assert ".partial-" not in line and not (work / "q8").exists() and debris(work) == []
    assert (
        outputs.shown_path(work / ".q8.partial-123-abcdef/layer_1.safetensors") == work / "q8" / "layer_1.safetensors"
    )
    assert outputs.shown_path(work / ".s.csv.tmp-123-abcdef/new") == work / "s.csv"
    assert outputs.shown_path(work / "d" / ".files.tmp-9-0a0b0c/x.npy") == work / "d" / "x.npy"


def test_ctrl_c_says_what_each_output_keeps_and_that_the_same_command_resumes(model, work, monkeypatch):
    from esmc_mlx.tasks import store

    (work / "in.fa").write_text("".join(f">s{i}\n{WT[: 10 + i]}\n" for i in range(4)))
    write_part = store.EmbeddingStore.write_part

    def then_stopped(self, *args, **kwargs):
        write_part(self, *args, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(store.EmbeddingStore, "write_part", then_stopped)
    result = cli("embed", model, "in.fa", "-o", "emb", "--no-progress")
    assert result.exit_code == 1 and "Aborted" not in result.output and "Traceback" not in result.output
    stopped = [line for line in result.output.splitlines() if line.startswith("Stopped")]
    assert stopped == [
        "Stopped (Ctrl-C): emb keeps what this run finished, each file whole; run the same command "
        "again to go on from there."
    ], result.output
    monkeypatch.setattr(store.EmbeddingStore, "write_part", write_part)
    again = cli("embed", model, "in.fa", "-o", "emb", "--no-progress")
    assert again.exit_code == 0 and "4 already done" in again.output, again.output
    assert debris(work, work / "emb") == []


def test_ctrl_c_leaves_a_file_output_as_it_was(model, work, monkeypatch):
    assert score(model, "-o", "out.csv").exit_code == 0
    before = snapshot(work / "out.csv")

    def stopped(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("esmc_mlx.tasks.jobs.score_mutations", stopped)
    result = score(model, "-o", "out.csv")
    assert result.exit_code == 1 and "Stopped (Ctrl-C): out.csv is as it was." in result.output, result.output
    result = score(model, "-o", "new.csv")
    assert result.exit_code == 1 and "Stopped (Ctrl-C): new.csv was not written." in result.output
    assert snapshot(work / "out.csv") == before and debris(work) == [] and not (work / "new.csv").exists()


def test_scan_of_a_fasta_says_which_protein_of_how_many(model, work):
    (work / "three.fa").write_text("".join(f">p{i}\n{WT}\n" for i in range(3)))
    assert cli("scan", model, "--fasta", "three.fa", "-o", "s", "--no-plot").exit_code == 0
    (work / "three.fa").write_text("".join(f">p{i}\n{WT}\n" for i in range(4)))
    result = cli("scan", model, "--fasta", "three.fa", "-o", "s", "--no-plot")
    assert result.exit_code == 0, result.output
    assert "scan 1 of 1 (3 done before): p3" in result.output


# --- a returning user's API --------------------------------------------------------------------------
def test_embeddings_of_several_layers_are_keyed_by_layer(model):
    from esmc_mlx import load

    m, _ = load(model)
    emb = m.embed([WT, WT[:9]], layers="3,-1", pools="mean,per-residue")
    assert set(emb.mean) == {3, 6} and emb.layer is None
    np.testing.assert_array_equal(emb.mean[-1], emb.get("mean", layer=6))
    np.testing.assert_array_equal(emb.per_residue[3][1], emb.get("per_residue", layer=3)[1])
    with pytest.raises(AttributeError, match=r"mean holds one array per layer \(3, 6\).*\.mean\[6\]"):
        emb.mean.shape  # noqa: B018
    with pytest.raises(ScoringError, match="hold layers 3, 6; say which with layer="):
        emb.get("mean")
    with pytest.raises(KeyError, match="no mean embeddings of layer 2"):
        emb.mean[2]
    one = m.embed([WT])
    assert one.mean.shape == (1, 256) and one.layer == 6 and one.get("mean").shape == (1, 256)
    many = m.embed([WT] * 50, layers="all", pools="mean,max,cls,per-residue")
    assert len(repr(many)) < 200 and repr(many).startswith("Embeddings(50 sequences, hidden size 256")
    assert len(repr(many.per_residue)) < 400


def test_read_embeddings_of_several_layers(model, tmp_path):
    (tmp_path / "in.fa").write_text(f">a\n{WT}\n>b\n{WT[:12]}\n")
    result = cli("embed", model, tmp_path / "in.fa", "-o", tmp_path / "e", "--layers", "2,-1", "--per-residue")
    assert result.exit_code == 0, result.output
    stored = read_embeddings(tmp_path / "e")
    assert set(stored.mean) == {2, 6} and np.asarray(stored.mean[-1]).shape == (2, 256)
    with pytest.raises(JobError, match="holds layers 2, 6; say which with layer="):
        stored.get("mean")
    assert repr(stored) == "StoredEmbeddings(2 records, hidden size 256, layers [2, 6], pools [mean, per_residue])"
    assert stored.per_residue("b", layer=-1).shape == (12, 256)


# --- the packaged SAE ----------------------------------------------------------------------------------
def test_the_packaged_sae_runs_offline_on_esmc_tiny(model, work):
    sae = load_sae("tiny")
    assert sae.config.d_model == 256 and sae.config.available_layers == (4,)
    assert sum(p.stat().st_size for p in (PACKAGED / "esmc-tiny-sae").iterdir()) < 1_000_000
    result = cli("features", model, "--sae", "tiny", "--sequence", WT, "-o", "feats", "--no-plot", "--no-progress")
    assert result.exit_code == 0, result.output
    summary = (work / "feats" / "summary.csv").read_text().splitlines()
    assert summary[0].startswith("id,layer,rank") and len(summary) > 1


# --- cards say what exists -----------------------------------------------------------------------------
def test_a_model_card_reruns_validation_against_the_source_it_records(model, tmp_path):
    from esmc_mlx.hub.card import render_card, rerun_reference

    card = render_card(model, "my-org/tiny")
    assert "--reference tiny" in card and "SOURCE_CHECKPOINT" not in card  # converted from the bundled tiny
    assert rerun_reference({"source": {"id": "biohub/ESMC-300M"}}) == "biohub/ESMC-300M"
    assert (
        rerun_reference({"source": {"id": "/home/alice/ckpt/esmc_300m_2024_12_v0.pth"}}) == "esmc_300m_2024_12_v0.pth"
    )
    assert rerun_reference({}) == "SOURCE_CHECKPOINT"  # only where nothing was recorded
