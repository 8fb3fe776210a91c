"""``esmc-mlx fold``: fold every record of a FASTA file (or one ``--sequence``) into a folder,
resumably.

Per record (``<id>`` is its FASTA ID, or ``--name``, made file-safe), into OUT::

    <id>.pdb                  the best-ranked sample (highest pTM), pLDDT (0-100) in the B-factor
                              column; <id>.cif with --format cif (mmCIF)
    <id>_sample{k}.pdb        with --samples N > 1: every sample k = 0 .. N-1 (the best is also <id>.pdb)
    <id>_pae.npy              (L, L) float32: the best sample's predicted aligned error, in angstrom
    <id>_pae.png              that matrix drawn (with matplotlib installed)
    summary.csv               one row per structure: id, length, chains, mean_plddt (0-100), ptm,
                              iptm (empty for one chain), seconds, sample (the best's k)
    fold-manifest.json        what each record's files were made from (a rerun skips them)

A rerun of the same command skips the records already folded (the same sequence under the same
ID, the same model and settings) and folds the rest; OUT holding structures made with other
settings or of another sequence under an ID is refused, ``force`` starts over.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import time
import warnings
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from ...artifact import plural
from ...errors import EsmcMlxWarning, JobError, install_hint
from ...fold_config import FoldConfig
from ...outputs import guard, guarded, held, note_stopped
from .. import scoring
from ..fasta import iter_fasta, read_sequence_option
from ..jobs import check_fasta_file
from ..scan import ScanManifest, safe_name
from ..scoring import forward_bytes
from ..store import sequence_hash
from .features import atom_counts, chain_tag, chains_from_text
from .predict import FoldingModel, Structure, fold, load_fold
from .structure import pdb_problem

KIND = "structures"  # the output folder's kind (not "fold": a fold artifact's)
FORMATS = {"pdb": ".pdb", "cif": ".cif"}
SUMMARY = "summary.csv"
SUMMARY_COLUMNS = ("id", "length", "chains", "mean_plddt", "ptm", "iptm", "seconds", "sample")
# Estimating a fold's peak memory: [L, L, pairwise] tensors alive at once in a pair-update layer
# (its input and output, the triangle update's two streams and result, the pair states the
# trunk carries across loops), an upper count checked against measured peaks in tests.
PAIR_COPIES = 12


class FoldManifest(ScanManifest):
    NAME = "fold-manifest.json"
    FORMAT = "esmc-mlx-fold/1"
    TOOL = "fold"


@dataclasses.dataclass
class Folded:
    """One record folded by this run: its summary row."""

    id: str
    row: dict

    @property
    def text(self) -> str:
        r = self.row
        chains = int(r["chains"])
        iptm = f", ipTM {float(r['iptm']):.3f}" if r["iptm"] else ""
        return (
            f"{self.id}: {plural(int(r['length']), 'residue')}{f' in {chains} chains' if chains > 1 else ''}, "
            f"mean pLDDT {float(r['mean_plddt']):.1f}, pTM {float(r['ptm']):.3f}{iptm} ({float(r['seconds']):.1f} s)"
        )


@dataclasses.dataclass
class FoldSummary:
    """What ``fold_job`` did (the fields ``echo_resumable`` reads, and the records it folded)."""

    out: Path
    total: int  # records given
    skipped: int  # already in OUT
    folded: list[Folded]
    heatmaps: bool  # whether PAE heatmaps were drawn (matplotlib installed)
    seconds: float = 0.0  # folding, the model's loading excluded
    rank: int = 0
    world_size: int = 1
    dropped: int = 0

    @property
    def computed(self) -> int:
        return len(self.folded)

    @property
    def summary(self) -> Path:
        return self.out / SUMMARY


def fold_records(sequence: str | None, fasta, name: str | None) -> list[tuple[str, list[str]]]:
    """(ID, chains) of ``sequence`` (one protein or complex, chains separated by ``|``, or a FASTA
    file of one record; named ``name``, else its FASTA ID, else ``sequence``) or of every record
    of ``fasta``, all checked before anything runs. Raises JobError, FastaError, SequenceError,
    FoldError naming the record."""
    if (sequence is None) == (fasta is None):
        raise JobError("give a FASTA file or --sequence (one of them)")
    if fasta is not None and name is not None:  # it would be ignored: say so instead
        raise JobError(f"--name {name!r} names --sequence's files; a FASTA file's records are named by their IDs")
    if fasta is not None:
        check_fasta_file(fasta, "fold")
        records = [(r.id, r.sequence, f"{fasta}, record {r.id!r}") for r in iter_fasta(fasta)]
    else:
        if ":" in sequence and not Path(sequence).expanduser().exists():
            chains_from_text(sequence, "--sequence")  # says that ':' is no chain separator here
        ident, seq = read_sequence_option(sequence)
        records = [(name or ident or "sequence", seq, "--sequence")]
    out, seen = [], {}
    for ident, seq, where in records:
        chains = chains_from_text(seq, where)
        if ident in seen:
            raise JobError(f"{fasta}: the ID {ident!r} names two records; give each record its own ID")
        seen[ident] = True
        out.append((ident, chains))
    return out


def file_names(ident: str, fmt: str, samples: int, plot: bool) -> dict[str, str]:
    """The files a record's structure goes to: key -> name in OUT (this module's docstring)."""
    stem, suffix = safe_name(ident), FORMATS[fmt]
    names = {"structure": stem + suffix}
    if samples > 1:
        names |= {f"sample{k}": f"{stem}_sample{k}{suffix}" for k in range(samples)}
    names["pae"] = f"{stem}_pae.npy"
    if plot:
        names["png"] = f"{stem}_pae.png"
    return names


def check_names(records, fmt: str, samples: int, fasta) -> None:
    """JobError when two records would write the same file (``a`` and ``a_sample0`` with --samples 2,
    ``P1`` and ``p1`` on a case-blind file system)."""
    owner: dict[str, str] = {}
    for ident, _ in records:
        for name in file_names(ident, fmt, samples, plot=True).values():
            other = owner.setdefault(name.lower(), ident)
            if other != ident:
                raise JobError(
                    f"{fasta or '--sequence'}: the records {other!r} and {ident!r} would both be written as {name}; "
                    "rename one of them"
                )


def check_format(records, fmt: str) -> None:
    """JobError, before any fold, naming a record PDB's fixed columns cannot hold."""
    if fmt != "pdb":
        return
    for ident, chains in records:
        problem = pdb_problem(len(chains), atom_counts(chains)[0], max(map(len, chains)))
        if problem:
            raise JobError(f"record {ident!r}: {problem} (--format cif)")


# --- memory ----------------------------------------------------------------------------------
def fold_bytes(config: FoldConfig, chains: list[str], samples: int, itemsize: int = 4) -> int:
    """An upper estimate of the activation memory of one fold of ``chains`` (L residues, A atoms)
    drawing ``samples`` samples, in the compute dtype of ``itemsize`` bytes: the trunk's
    [L, L, pairwise] pair stack (``PAIR_COPIES`` at once, plus one ``chunk_size`` slab of the
    triangle updates and transitions), the backbone's forward with every hidden state kept, what
    the structure head holds for the whole sampling (the atom window mask [A, A] and one
    [heads, L, L] attention bias per diffusion layer), and the larger of the sampler (the
    [samples, heads, A, A] and [samples, heads, L, L] attention scores where attention is not
    fused: on the CPU) and the confidence head (its own pair stack over every sample, the PAE and
    PDE logits)."""
    L, (_, A), S = sum(map(len, chains)), atom_counts(chains), samples
    p, f32 = config.pairwise_hidden_size, 4
    rows = min(config.chunk_size or L, L)
    cpu = mx.default_device().type == mx.DeviceType.cpu

    def pair_stack(batch: int) -> int:
        slab = rows * L * (12 * p + 2 * config.pair_transition_intermediate_size)
        return batch * itemsize * (PAIR_COPIES * L * L * p + slab)

    def scores(batch: int, heads: int, n: int) -> int:
        return 2 * f32 * batch * heads * n * n if cpu else 0  # the scores and their softmax

    lm, head = config.esmc_config, config.structure_head
    diffusion, atom_heads = head.diffusion_module, config.atom_encoder.num_attention_heads
    backbone = forward_bytes(lm, 1, L + 2 * len(chains), hidden_states=True)
    backbone += f32 * L * (lm.num_hidden_layers + 1) * (lm.hidden_size + p)  # the states gathered, projected
    trunk = backbone + pair_stack(1) + itemsize * A * A + scores(1, atom_heads, A)
    kept = f32 * L * L * (p + head.num_distogram_bins)  # the trunk's pair states and distogram
    conditioning = itemsize * (
        diffusion.num_hidden_layers * diffusion.num_attention_heads * L * L
        + A * A
        + L * L * (4 * p + diffusion.pair_intermediate_size)
    )
    sampler = scores(S, diffusion.atom_encoder.num_attention_heads, A) + scores(S, diffusion.num_attention_heads, L)
    sampler += f32 * S * A * 4 * (diffusion.atom_encoder.hidden_size + diffusion.atom_encoder.intermediate_size)
    confidence = config.confidence_head
    scored = pair_stack(S) + 2 * f32 * S * L * L * (confidence.num_pae_bins + confidence.num_pde_bins)
    return kept + conditioning + max(trunk, sampler, scored)


def weight_bytes(model: FoldingModel) -> int:
    """The bytes the model's weights hold, the backbone's included."""
    arrays = [a for _, a in tree_flatten(model.parameters())] + [a for _, a in tree_flatten(model.esmc.parameters())]
    return sum(a.nbytes for a in arrays)


def check_memory(model: FoldingModel, records, samples: int, where) -> None:
    """JobError naming the first record whose fold (``fold_bytes``, plus the weights) would need more
    memory than this machine has (``scoring.memory_bytes``), before anything is folded."""
    have, weights = scoring.memory_bytes(), weight_bytes(model)
    itemsize = model.dtype.size
    too_big = []
    for ident, chains in records:
        need = weights + fold_bytes(model.config, chains, samples, itemsize)
        if need > have:
            too_big.append((ident, chains, need))
    if too_big:
        ident, chains, need = too_big[0]
        others = f" ({plural(len(too_big) - 1, 'other record')} too)" if len(too_big) > 1 else ""
        fewer = ", with fewer --samples" if samples > 1 else ""
        raise JobError(
            f"{where}record {ident!r} ({sum(map(len, chains)):,} residues, {plural(len(chains), 'chain')}): its fold "
            f"would need about {need / 2**30:,.1f} GiB with the model's weights, more than the {have / 2**30:,.1f} GiB "
            f"here{others}; fold it on a machine with more memory{fewer}, or fold its domains apart"
        )


# --- writing ---------------------------------------------------------------------------------
def plotting_available() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def plot_pae(path: Path, pae: np.ndarray, name: str, chains: list[str], ptm: float) -> Path:
    """The PAE matrix as a square image (scored residue along x, aligned residue along y, as
    AlphaFold's viewers draw it; 0 A dark), chain boundaries as lines. Needs matplotlib."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    n = len(pae)
    fig = Figure(figsize=(5.6, 4.8), dpi=100, layout="constrained")
    ax = fig.add_subplot()
    # one scale for every record (ESMFold2's PAE bins end at 32 A), so that figures compare
    top = max(32.0, float(np.max(pae)))
    image = ax.imshow(pae, cmap="Greens_r", vmin=0.0, vmax=top, interpolation="nearest")
    image.set_extent((0.5, n + 0.5, n + 0.5, 0.5))
    for edge in np.cumsum([len(c) for c in chains])[:-1]:
        ax.axhline(edge + 0.5, color="black", linewidth=0.6)
        ax.axvline(edge + 0.5, color="black", linewidth=0.6)
    ax.set_xlabel("scored residue", fontsize=8)
    ax.set_ylabel("aligned residue", fontsize=8)
    ax.tick_params(labelsize=7)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    bar = fig.colorbar(image, ax=ax, shrink=0.8)
    bar.set_label("expected position error (A)", fontsize=7)
    bar.ax.tick_params(labelsize=7)
    tags = "" if len(chains) == 1 else f", chains {' '.join(chain_tag(i) for i in range(len(chains)))}"
    ax.set_title(f"{name}: predicted aligned error, pTM {ptm:.3f}{tags}", fontsize=8)
    with open(path, "xb") as f:  # (a new file: staged by the caller)
        fig.savefig(f, dpi=100, format="png")
    return path


def summary_row(ident: str, structure: Structure) -> dict:
    """The summary CSV's row of a structure (the best sample's scores), as text."""
    best = structure.best
    chains = len(structure.chains)
    return {
        "id": ident,
        "length": str(sum(map(len, structure.chains))),
        "chains": str(chains),
        "mean_plddt": f"{100 * float(structure.plddt[best].mean()):.6g}",
        "ptm": f"{float(structure.ptm[best]):.6g}",
        "iptm": f"{float(structure.iptm[best]):.6g}" if chains > 1 else "",
        "seconds": f"{structure.seconds:.3f}",
        "sample": str(best),
    }


def write_structure(out: Path, ident: str, structure: Structure, fmt: str, plot: bool) -> dict[str, Path]:
    """Write one record's files (``file_names``) into the fold folder ``out``: written aside and
    moved into place together, or none of them."""
    names = file_names(ident, fmt, len(structure.coords), plot)
    best = structure.best

    def text(sample: int) -> str:
        return structure.to_pdb(sample) if fmt == "pdb" else structure.to_mmcif(sample, name=safe_name(ident))

    with guard(out, KIND, "folder") as folder, folder.files() as staged:
        with staged.open(names["structure"], "w") as f:
            f.write(text(best))
        for k in range(len(structure.coords) if "sample0" in names else 0):
            with staged.open(names[f"sample{k}"], "w") as f:
                f.write(text(k))
        with staged.open(names["pae"], "wb") as f:
            np.save(f, np.asarray(structure.pae[best], dtype=np.float32))
        if plot:
            plot_pae(
                staged.path(names["png"]), structure.pae[best], ident, structure.chains, float(structure.ptm[best])
            )
    return {key: Path(out) / name for key, name in names.items()}


def write_summary(out: Path, manifest: FoldManifest) -> None:
    """``summary.csv``: the row of every structure OUT holds, in the order they were folded
    (rewritten only when that changed)."""
    entries = [e for e in manifest.proteins.values() if isinstance(e, dict)]
    rows = [e["summary"] for e in entries if isinstance(e.get("summary"), dict)]
    text = io.StringIO()
    writer = csv.DictWriter(text, fieldnames=SUMMARY_COLUMNS, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    with guard(out, KIND, "folder") as folder:
        path = folder.path / SUMMARY
        if folder.owns(SUMMARY) and path.is_file() and path.read_text(encoding="utf-8") == text.getvalue():
            return
        with folder.file(SUMMARY, "w", encoding="utf-8", newline="") as f:
            f.write(text.getvalue())


# --- the job ---------------------------------------------------------------------------------
def _settings(model_weights: str, samples: int, steps: int | None, loops: int | None, seed: int, fmt: str) -> dict:
    """What a record's files depend on besides its sequence."""
    return {"model": model_weights, "samples": samples, "steps": steps, "loops": loops, "seed": seed, "format": fmt}


def _difference(key: str, there, now) -> str:
    if key == "model":
        return "another model's weights"
    shown = {None: "the model's"}
    return f"{key}: {shown.get(there, there)} there, {shown.get(now, now)} now"


def _open_manifest(out, records, settings: dict, force: bool) -> FoldManifest:
    """OUT's manifest, cleared with ``force``; JobError when it holds structures made with other
    settings, or of another sequence under one of ``records``' IDs."""
    folder = held(out)
    manifest = FoldManifest(folder)
    if force:
        folder.clear()
        manifest.proteins = {}
        return manifest
    for entry in manifest.proteins.values():
        there = entry.get("settings") if isinstance(entry, dict) else None
        if not isinstance(there, dict):
            continue
        differ = [_difference(k, there.get(k), v) for k, v in settings.items() if there.get(k) != v]
        if differ:
            raise JobError(
                f"{out} holds structures made with other settings ({'; '.join(differ)}); use another output "
                "directory or --force to start over"
            )
    for ident, chains in records:
        entry = manifest.proteins.get(safe_name(ident))
        there = entry.get("settings", {}).get("sequence_sha1") if isinstance(entry, dict) else None
        if there is not None and there != sequence_hash("|".join(chains)):
            raise JobError(
                f"{out} holds the structure of another sequence under the ID {ident!r}; use another output "
                "directory or --force"
            )
    return manifest


@guarded("out", KIND, "folder", inputs=("model", "fasta", "sequence"))
def fold_job(
    model: FoldingModel | str | Path,
    out: str | Path,
    *,
    sequence: str | None = None,
    fasta: str | Path | None = None,
    name: str | None = None,
    samples: int = 1,
    steps: int | None = None,
    loops: int | None = None,
    seed: int = 0,
    fmt: str = "pdb",
    force: bool = False,
    progress: bool = False,
) -> FoldSummary:
    """Fold ``sequence`` (a protein or complex, chains separated by ``|``, or a FASTA file of one
    record) or every record of ``fasta`` into the folder ``out`` (this module's docstring gives the
    layout). ``model``: a loaded fold model, or a fold artifact (directory, alias, Hub repo id) to
    load once the input has been checked. ``samples``, ``steps``, ``loops``, ``seed``: as
    ``tasks.fold.fold`` takes them (each record folded with ``seed``: its structure does not depend
    on the records before it); ``fmt``: ``pdb`` or ``cif``.

    Every record is checked before the model loads, and each against this machine's memory before
    the first fold (``check_memory``). Resumes: records OUT already holds from the same sequence,
    model and settings are skipped; ``force`` clears what esmc-mlx wrote there and starts over.
    On Ctrl-C the records already written stay (the Stopped line says how many: ``outputs.note_stopped``).
    Raises FastaError, SequenceError, FoldError, JobError, OutputError."""
    if fmt not in FORMATS:
        raise JobError(f"format {fmt!r}: choose pdb or cif")
    for value, option, least in ((samples, "samples", 1), (steps, "steps", 1), (loops, "loops", 0), (seed, "seed", 0)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < least):
            raise JobError(f"{option} must be an integer of at least {least}, got {value!r}")
    records = fold_records(sequence, fasta, name)
    check_names(records, fmt, samples, fasta)
    check_format(records, fmt)
    plot = plotting_available()
    if not plot:
        warnings.warn(
            f"no PAE heatmaps (<id>_pae.png): drawing them needs matplotlib ({install_hint('plot')}); the PAE "
            "arrays (<id>_pae.npy) are written",
            EsmcMlxWarning,
            stacklevel=2,
        )
    if isinstance(model, (str, Path)):
        model = load_fold(model)
    settings = _settings(model.fingerprint(), samples, steps, loops, seed, fmt)
    manifest = _open_manifest(out, records, settings, force)
    folder = held(out)

    def entry(chains: list[str]) -> dict:
        return {"sequence_sha1": sequence_hash("|".join(chains)), **settings}

    pending = [(i, c) for i, c in records if not manifest.done(safe_name(i), entry(c))]
    where = f"{fasta}: " if fasta is not None else ""
    check_memory(model, pending, samples, where)
    for ident, _ in pending:  # a file of the user's where a structure would go: refused before any fold
        for file in [*file_names(ident, fmt, samples, plot).values(), SUMMARY]:
            folder.check_free(file)

    from tqdm.auto import tqdm

    folded: list[Folded] = []
    started = time.perf_counter()
    bar = tqdm(
        total=len(records),
        initial=len(records) - len(pending),
        unit="structure",
        desc="fold",
        disable=not progress,
        dynamic_ncols=True,
    )
    try:
        for ident, chains in pending:
            bar.set_postfix_str(ident if len(ident) <= 24 else ident[:23] + "…")
            structure = fold(model, chains, samples=samples, steps=steps, loops=loops, seed=seed)
            paths = write_structure(Path(out), ident, structure, fmt, plot)
            row = summary_row(ident, structure)
            manifest.record(safe_name(ident), entry(chains), paths, summary=row)
            write_summary(Path(out), manifest)
            folded.append(Folded(ident, row))
            bar.update()
    except KeyboardInterrupt:
        held_now = sum(1 for i, c in records if manifest.done(safe_name(i), entry(c)))
        note_stopped(
            f"{out} keeps {plural(held_now, 'structure')} of {len(records)} ({len(folded)} folded by this run); "
            "run the same command again to fold the rest"
        )
        raise
    finally:
        bar.close()
    if manifest.proteins and folder.path.is_dir():
        write_summary(Path(out), manifest)  # (a run stopped between a record's files and its row)
    seconds = time.perf_counter() - started
    return FoldSummary(Path(out), len(records), len(records) - len(pending), folded, plot, seconds)
