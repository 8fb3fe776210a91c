"""The sequences validation runs: real proteins, plus inputs derived from them, in padded batches.

From the records of a FASTA file (the bundled ``data/panel.fasta`` unless the user gives one):
  * every record: the longest whole (positions past esmc-tiny's 1,022-residue training crop), every
    other one cropped to its first ``record_window`` residues (``max_length`` crops them all);
  * a two-chain input: two records joined by the chain break ``|`` (run with ``sequence_id``);
  * ``<mask>`` inputs: records with 15% of their residues replaced by ``<mask>``;
  * masked-marginal rows: one row per sampled (record, position), that residue masked in a
    window of ``marginal_window`` residues around it; their logits give the variant scores
    whose Spearman correlation quality reports.
Cost (docs/validation.md): attention grows with the square of a row's length, so the long
record is there once, and the 24 marginal rows are short windows rather than 24 copies of a
record. Inputs are sorted by length and packed into right-padded batches of bounded token count
and bounded length spread (``PAD_SLACK``), so padding is exercised but costs little.
"""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path

import numpy as np

from ..errors import FastaError
from ..privacy import public_path
from ..runtime.tokenizer import ESMCTokenizer
from ..tasks.fasta import read_fasta
from ..tasks.fold.features import chains_from_text
from ..vocab import AMINO_ACIDS

PANEL_PATH = Path(__file__).resolve().parent.parent / "data" / "panel.fasta"
FOLD_PANEL_PATH = PANEL_PATH.with_name("fold_panel.fasta")
MASK = "<mask>"
RECORD_WINDOW = 256  # residues kept of every record but the longest
MARGINAL_WINDOW = 64  # residues of context around a masked-marginal position
PAD_SLACK = 1.25  # a batch's longest row is at most this times its shortest (plus a few tokens)


@dataclasses.dataclass(frozen=True)
class Input:
    name: str
    tokens: tuple[str, ...]  # residue tokens, without <cls>/<eos>
    kind: str  # record | two-chain | masked | marginal
    marginal: tuple[str, int, str] | None = None  # (record name, 0-based position in this row, wild-type residue)

    @property
    def text(self) -> str:
        return "".join(self.tokens)

    @property
    def length(self) -> int:  # tokens the model sees, <cls> and <eos> included
        return len(self.tokens) + 2


@dataclasses.dataclass
class Batch:
    rows: list[int]  # indices into Panel.inputs
    input_ids: np.ndarray  # (B, L) int32
    attention_mask: np.ndarray  # (B, L) int32
    sequence_id: np.ndarray | None  # (B, L) int32 when a row has a chain break, else None


@dataclasses.dataclass
class Panel:
    inputs: list[Input]
    source: str
    sha256: str | None
    max_length: int | None

    @property
    def tokens(self) -> int:
        return sum(i.length for i in self.inputs)

    @property
    def digest(self) -> str:
        """sha256 of the inputs themselves (names, kinds, tokens): what a cached reference
        output was computed on, whatever file or options produced them."""
        h = hashlib.sha256()
        for i in self.inputs:
            h.update(f"{i.kind}\t{i.name}\t{' '.join(i.tokens)}\t{i.marginal}\n".encode())
        return h.hexdigest()

    def describe(self) -> dict:
        kinds: dict[str, int] = {}
        for i in self.inputs:
            kinds[i.kind] = kinds.get(i.kind, 0) + 1
        lengths = [len(i.tokens) for i in self.inputs if i.kind == "record"]
        return {
            "source": self.source,
            "sha256": self.sha256,
            "digest": self.digest,
            "inputs": len(self.inputs),
            "by_kind": kinds,
            "tokens": self.tokens,
            "record_lengths": lengths,
            "max_length": self.max_length,
        }

    def batches(self, max_tokens: int = 4096) -> list[Batch]:
        """Right-padded batches, rows sorted by length, B x L <= max_tokens (one row at least),
        the longest row of a batch at most PAD_SLACK times its shortest (+8 tokens)."""
        tok = ESMCTokenizer()
        order = sorted(range(len(self.inputs)), key=lambda i: self.inputs[i].length)
        groups: list[list[int]] = []
        for i in order:
            length = self.inputs[i].length
            if (
                groups
                and (len(groups[-1]) + 1) * length <= max_tokens
                and length <= PAD_SLACK * self.inputs[groups[-1][0]].length + 8
            ):
                groups[-1].append(i)
            else:
                groups.append([i])
        out = []
        for rows in groups:
            enc = tok(
                [self.inputs[r].text for r in rows],
                return_tensors="np",
                return_sequence_id=True,
                names=[self.inputs[r].name for r in rows],
            )
            chained = bool((enc["input_ids"] == tok.chain_break_token_id).any())
            out.append(Batch(rows, enc["input_ids"], enc["attention_mask"], enc["sequence_id"] if chained else None))
        return out


def build_panel(
    fasta: str | Path | None = None,
    max_length: int | None = None,
    masked_inputs: int = 2,
    marginal_positions: int = 24,
    seed: int = 0,
    record_window: int | None = RECORD_WINDOW,
    marginal_window: int | None = MARGINAL_WINDOW,
) -> Panel:
    """Read ``fasta`` (default: the bundled panel) and derive the two-chain, ``<mask>`` and
    masked-marginal inputs. ``max_length`` crops every record; otherwise the longest stays whole
    and the others are cut to ``record_window`` residues (None: all whole). Marginal rows see
    ``marginal_window`` residues around their position (None: the whole record). Raises
    FastaError (an EsmcMlxError) for an unreadable file."""
    path = Path(fasta) if fasta is not None else PANEL_PATH
    records = read_fasta(path)
    rng = np.random.default_rng(seed)
    longest = max(range(len(records)), key=lambda k: len(records[k].sequence)) if records else -1

    def crop(k: int, seq: str) -> str:
        if max_length:
            return seq[:max_length]
        return seq if k == longest or not record_window else seq[:record_window]

    recs = [(r.id, tuple(crop(k, r.sequence))) for k, r in enumerate(records)]
    inputs = [Input(name, toks, "record") for name, toks in recs]
    by_length = sorted(recs, key=lambda r: len(r[1]))
    if len(recs) >= 2:  # the two shortest records that are not tiny, as chain A | chain B
        pair = [r for r in by_length if len(r[1]) >= 20][:2] or by_length[:2]
        if len(pair) == 2:
            (a, ta), (b, tb) = pair
            inputs.append(Input(f"{a}|{b}", (*ta, "|", *tb), "two-chain"))
    for name, toks in _spread(by_length, masked_inputs):
        hide = rng.choice(len(toks), size=max(1, round(0.15 * len(toks))), replace=False)
        masked = tuple(MASK if i in set(hide.tolist()) else t for i, t in enumerate(toks))
        inputs.append(Input(f"{name} (15% masked)", masked, "masked"))
    inputs.extend(_marginal_rows(recs, marginal_positions, rng, marginal_window))
    digest = hashlib.sha256(path.read_bytes()).hexdigest() if path.exists() else None
    # the FASTA by its name alone: the report is published, a path typed here never is
    return Panel(inputs, public_path(path) if fasta is not None else "esmc_mlx/data/panel.fasta", digest, max_length)


def _spread(records: list[tuple[str, tuple[str, ...]]], n: int) -> list[tuple[str, tuple[str, ...]]]:
    """``n`` records spread over the length range, preferring those of 50-300 residues (long ones
    make every masked row expensive, very short ones have few positions)."""
    if n <= 0 or not records:
        return []
    pool = [r for r in records if 50 <= len(r[1]) <= 300] or records
    picks = np.linspace(0, len(pool) - 1, num=min(n, len(pool))).round().astype(int)
    return [pool[i] for i in dict.fromkeys(picks.tolist())]


def _marginal_rows(records, positions: int, rng, window: int | None) -> list[Input]:
    chosen = _spread(sorted(records, key=lambda r: len(r[1])), min(3, positions))
    rows = []
    for k, (name, toks) in enumerate(chosen):
        share = positions // len(chosen) + (1 if k < positions % len(chosen) else 0)
        candidates = [i for i, t in enumerate(toks) if t in AMINO_ACIDS]
        if not candidates or share == 0:
            continue
        for pos in sorted(rng.choice(candidates, size=min(share, len(candidates)), replace=False).tolist()):
            start = 0 if not window else min(max(0, pos - window // 2), max(0, len(toks) - window))
            stop = len(toks) if not window else start + window
            masked = toks[start:pos] + (MASK,) + toks[pos + 1 : stop]
            where = f" [{start + 1}-{min(stop, len(toks))}]" if (start, stop) != (0, len(toks)) and window else ""
            rows.append(
                Input(f"{name} {toks[pos]}{pos + 1}<mask>{where}", masked, "marginal", (name, pos - start, toks[pos]))
            )
    return rows


@dataclasses.dataclass(frozen=True)
class Protein:
    """One protein of a fold panel: a chain, or a complex of several."""

    name: str
    chains: tuple[str, ...]

    @property
    def residues(self) -> int:
        return sum(map(len, self.chains))


@dataclasses.dataclass
class FoldPanel:
    """The proteins a fold validation folds (``build_fold_panel``)."""

    proteins: list[Protein]
    source: str
    sha256: str | None
    max_length: int | None

    @property
    def residues(self) -> int:
        return sum(p.residues for p in self.proteins)

    def describe(self) -> dict:
        return {
            "source": self.source,
            "sha256": self.sha256,
            "inputs": len(self.proteins),
            "complexes": sum(len(p.chains) > 1 for p in self.proteins),
            "residues": self.residues,
            "chain_lengths": {p.name: [len(c) for c in p.chains] for p in self.proteins},
            "max_length": self.max_length,
        }


def build_fold_panel(fasta: str | Path | None = None, max_length: int | None = None) -> FoldPanel:
    """The proteins of ``fasta`` (default: the bundled ``data/fold_panel.fasta``), one per record,
    chains split at ``|`` (a complex); ``max_length`` crops every chain. Raises FastaError or
    FoldError (EsmcMlxErrors) for a file that is not FASTA or a record the fold cannot take,
    naming the record."""
    path = Path(fasta) if fasta is not None else FOLD_PANEL_PATH
    proteins = []
    for record in read_fasta(path):
        chains = chains_from_text(record.sequence, record.id)
        proteins.append(Protein(record.id, tuple(c[:max_length] if max_length else c for c in chains)))
    if not proteins:
        raise FastaError(f"{path}: no records to fold")
    digest = hashlib.sha256(path.read_bytes()).hexdigest() if path.exists() else None
    return FoldPanel(
        proteins, public_path(path) if fasta is not None else "esmc_mlx/data/fold_panel.fasta", digest, max_length
    )


__all__ = [
    "Batch",
    "FoldPanel",
    "Input",
    "Panel",
    "Protein",
    "build_fold_panel",
    "build_panel",
    "FOLD_PANEL_PATH",
    "PANEL_PATH",
]
