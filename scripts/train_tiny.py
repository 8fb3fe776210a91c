#!/usr/bin/env python3
"""Build the esmc-tiny dataset from Debian packages, train esmc-tiny, write the checkpoint.

esmc-tiny is a 6-layer, 256-wide ESMC (transformers' ``EsmcForMaskedLM``) trained with masked
language modelling on the real protein sequences that three Debian packages ship as files:

    apt-get install emboss-test hmmer-examples any2fasta-examples

Steps (docs/esmc-tiny.md has the figures of the shipped run):

    # 1. on a machine with the packages: gather, deduplicate, split; write the prepared FASTA,
    #    the provenance manifest and the validation panel (esmc_mlx/data/panel.fasta + PANEL.md)
    python scripts/train_tiny.py prepare

    # 2. train on scripts/data/esmc-tiny-dataset.fasta (no apt packages needed here, only torch,
    #    transformers >= 5.17, safetensors, numpy); writes config.json, model.safetensors,
    #    tokenizer files, README.md and metrics.json into --out
    python scripts/train_tiny.py train --device cuda --out OUT

Everything is seeded (--seed, default 0): the split, the crops, the masks, the initialisation.
CUDA kernels are not all bitwise deterministic, so a rerun on a GPU reproduces the figures to
about the third decimal, not bit for bit.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import math
import os
import random
import re
import sys
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DATA_DIR = REPO / "scripts" / "data"
DATASET = DATA_DIR / "esmc-tiny-dataset.fasta"
MANIFEST = DATA_DIR / "esmc-tiny-manifest.json"
PANEL_FASTA = REPO / "esmc_mlx" / "data" / "panel.fasta"
PANEL_MD = REPO / "esmc_mlx" / "data" / "PANEL.md"

EMBOSS = Path("/usr/share/EMBOSS/test")
HMMER = Path("/usr/share/doc/hmmer/examples")
ANY2FASTA = Path("/usr/share/doc/any2fasta/examples")

# licence keys -> what the docs and PANEL.md say about a record's origin and terms
LICENCES = {
    "uniprot": "UniProtKB entry (the 2012 files carry UniProt's then CC BY-ND notice; UniProt "
               "distributes all its data under CC BY 4.0 today). Attribution: The UniProt Consortium",
    "insdc": "INSDC (EMBL-Bank/GenBank/DDBJ) CDS translation: no restrictions on use or redistribution",
    "refseq": "NCBI RefSeq CDS translation: NCBI places no restrictions on use or distribution",
    "pfam": "Pfam seed alignment member (Pfam is CC0 1.0); sequence from UniProtKB (CC BY 4.0)",
    "pir": "PIR-International Protein Sequence Database (PIR-PSD), freely distributed",
    "wormbase": "WormBase wormpep: freely available, no restrictions",
    "emboss-fasta": "UniProtKB/Swiss-Prot sequence copied into an EMBOSS test file (CC BY 4.0 today)",
}

# (package, root, relative path, format, licence key). Chosen by reading the files: synthetic
# test sequences (prot.*, ambigprot, 20aa, 3box, M1, rndseq400) and nucleotide files are left out.
SOURCES = [
    ("emboss-test", EMBOSS, "swiss/seq.dat", "swiss", "uniprot"),
    ("emboss-test", EMBOSS, "swnew/trembl.dat", "swiss", "uniprot"),
    ("emboss-test", EMBOSS, "data/uniprotft.sw", "swiss", "uniprot"),
    ("emboss-test", EMBOSS, "data/exu2_drops.sw", "swiss", "uniprot"),
    ("emboss-test", EMBOSS, "data/amir.swiss", "swiss", "uniprot"),
    *[("emboss-test", EMBOSS, f"embl/{n}.dat", "embl", "insdc")
      for n in ("fun", "hum1", "inv", "pln", "pro", "rod", "syn", "vrt")],
    *[("emboss-test", EMBOSS, f"genbank/{n}.seq", "genbank", "insdc")
      for n in ("gbbct1", "gbinv1", "gbpln1", "gbpln2", "gbpri1", "gbrod1", "gbvrt")],
    *[("emboss-test", EMBOSS, f"pir/pir{i}.seq", "fasta", "pir") for i in (1, 2, 3, 4)],
    ("emboss-test", EMBOSS, "data/104k.nbrf", "fasta", "pir"),
    ("emboss-test", EMBOSS, "wormpep/wormpep", "fasta", "wormbase"),
    ("emboss-test", EMBOSS, "data/wormpep.clone.AB", "fasta", "wormbase"),
    ("emboss-test", EMBOSS, "data/wormpep.clone.ZK637", "fasta", "wormbase"),
    *[("emboss-test", EMBOSS, f"data/{n}", "fasta", "emboss-fasta")
      for n in ("globins.fasta", "hba.fa", "memepep.dat", "memeseqs.dat", "ops.fasta", "opsd.fasta",
                "op1.ali", "op2.ali", "paamir.pep", "tranalign.pep", "twoglob.fasta", "featprot.fasta",
                "iprtest.seq", "swnew", "swsplit")],
    ("emboss-test", EMBOSS, "data/PF00032_seed.sth", "stockholm", "pfam"),
    ("hmmer-examples", HMMER, "tutorial/7LESS_DROME", "swiss", "uniprot"),
    ("hmmer-examples", HMMER, "tutorial/HBB_HUMAN", "fasta", "uniprot"),
    ("hmmer-examples", HMMER, "tutorial/globins45.fa", "fasta", "uniprot"),
    ("hmmer-examples", HMMER, "testsuite/PAX8_HUMAN", "fasta", "uniprot"),
    ("hmmer-examples", HMMER, "easel/formats/fasta", "fasta", "uniprot"),
    ("hmmer-examples", HMMER, "easel/formats/uniprot.gz", "swiss", "uniprot"),
    ("hmmer-examples", HMMER, "easel/demotic/examples/example.fa", "fasta", "uniprot"),
    ("hmmer-examples", HMMER, "easel/demotic/examples/example-single.fa.gz", "fasta", "uniprot"),
    *[("hmmer-examples", HMMER, p, "stockholm", "pfam")
      for p in ("tutorial/globins4.sto", "tutorial/fn3.sto", "tutorial/Pkinase.sto",
                "testsuite/RRM_1.sto.gz", "testsuite/Caudal_act.sto.gz", "testsuite/Patched.sto.gz",
                "testsuite/LuxC.sto.gz", "testsuite/SMC_N.sto.gz", "testsuite/XYPPX.sto",
                "testsuite/minifam.gz", "easel/demotic/examples/example.sto.gz")],
    ("any2fasta-examples", ANY2FASTA, "test.gbk.gz", "genbank", "refseq"),
    ("any2fasta-examples", ANY2FASTA, "test.sth", "stockholm", "pfam"),
]
PRIORITY = ["uniprot", "refseq", "insdc", "pir", "wormbase", "emboss-fasta", "pfam"]

AMINO = set("ACDEFGHIKLMNPQRSTVWYXBZUO")
STANDARD = "LAGVSERTIDPKQNFYMHWC"  # the 20 standard residues, in ESMC's token order (ids 4..23)
MIN_LEN, MAX_CROP = 20, 1022
TEST_FRACTION, VAL_FRACTION = 0.10, 0.05


@dataclass
class Record:
    name: str  # unique: package:path:id
    id: str
    acc: str
    desc: str
    seq: str
    package: str
    path: str
    licence: str
    also_in: list = field(default_factory=list)


# --- parsers -----------------------------------------------------------------------------------
def _read(path: Path) -> str:
    data = path.read_bytes()
    if data[:2] == b"\x1f\x8b":
        data = gzip.decompress(data)
    return data.decode("latin-1")


def _clean(seq: str) -> str:
    """Ungap and uppercase; drop a terminal stop. An internal stop stays, so that the alphabet
    check rejects the record (a frame translation, not a protein)."""
    return re.sub(r"[\s\d.\-~_]", "", seq).upper().rstrip("*")


def parse_swiss(text):
    for entry in text.split("\n//"):
        lines = entry.strip("\n").splitlines()
        ids = [ln.split()[1] for ln in lines if ln.startswith("ID   ")]
        if not ids:
            continue
        acc = next((ln[5:].split(";")[0].strip() for ln in lines if ln.startswith("AC   ")), "")
        desc = " ".join(ln[5:].strip() for ln in lines if ln.startswith("DE   "))
        desc = (re.search(r"Full=([^;]+);", desc) or re.match(r"(.*)", desc)).group(1)
        try:
            start = next(i for i, ln in enumerate(lines) if ln.startswith("SQ   "))
        except StopIteration:
            continue
        yield ids[0], acc, desc, _clean("".join(lines[start + 1:]))


def parse_fasta(text):
    name, desc, chunks = None, "", []
    for line in text.splitlines() + [">"]:
        if line.startswith(">"):
            if name is not None:
                yield name, _acc_from(name, desc), desc, _clean("".join(chunks))
            head = line[1:].strip()
            if head.startswith(("P1;", "F1;")):  # NBRF/PIR: >P1;ID, the next line is the title
                head = head[3:]
                name, desc, chunks = head.split()[0] if head else "", None, []
                continue
            name, _, desc = head.partition(" ")
            chunks = []
        elif name is not None:
            if desc is None:  # NBRF title line
                desc = line.strip()
                continue
            chunks.append(line)


def _acc_from(name, desc):
    m = re.match(r"(?:sp|tr)\|([A-Z0-9]+)\|", name)
    if m:
        return m.group(1)
    m = re.match(r"\s*([OPQ][0-9][A-Z0-9]{3}[0-9]|[A-NR-Z][0-9](?:[A-Z][A-Z0-9]{2}[0-9]){1,2})\b", desc or "")
    return m.group(1) if m else ""


def parse_stockholm(text):
    for block in text.split("\n//"):
        seqs, accs, family = {}, {}, ""
        for line in block.splitlines():
            if line.startswith("#=GF AC"):
                family = line.split()[2]
            elif line.startswith("#=GS") and " AC " in line:
                parts = line.split()
                accs[parts[1]] = parts[3]
            elif line.strip() and not line.startswith("#"):
                parts = line.split()
                if len(parts) == 2:
                    seqs[parts[0]] = seqs.get(parts[0], "") + parts[1]
        for name, aligned in seqs.items():
            yield name, accs.get(name, name.split("/")[0]), f"{family} seed member", _clean(aligned)


def parse_features(text, embl: bool):
    """CDS /translation qualifiers of EMBL or GenBank flat files."""
    for entry in text.split("\n//"):
        lines = entry.splitlines()
        if embl:
            record_acc = next((ln[5:].split(";")[0].strip() for ln in lines if ln.startswith("AC   ")), "")
            feats = ["  " + ln[2:] for ln in lines if ln.startswith("FT")]
        else:
            record_acc = next((ln.split()[1] for ln in lines if ln.startswith("ACCESSION")), "")
            try:
                a = next(i for i, ln in enumerate(lines) if ln.startswith("FEATURES"))
                b = next(i for i, ln in enumerate(lines) if ln.startswith("ORIGIN") or i > a and ln[:1].isalpha())
            except StopIteration:
                continue
            feats = lines[a + 1:b]
        current, blocks = None, []
        for ln in feats:
            if len(ln) > 5 and ln[:5] == "     " and ln[5] != " ":
                current = [ln[5:].split()[0], ""]
                blocks.append(current)
            elif current is not None:
                s = ln.strip()
                current[1] += ("\n" if s.startswith("/") else " ") + s
        for key, quals in blocks:
            if key != "CDS":
                continue
            q = {k: a or b for k, a, b in re.findall(r'^/(\w+)(?:="([^"]*)"|=([^"\n]*))?', quals, re.M)}
            if "translation" not in q:
                continue
            pid = q.get("protein_id") or q.get("locus_tag") or q.get("gene") or record_acc
            yield pid, q.get("protein_id", record_acc), q.get("product", ""), _clean(q["translation"])


PARSERS = {
    "swiss": parse_swiss,
    "fasta": parse_fasta,
    "stockholm": parse_stockholm,
    "embl": lambda t: parse_features(t, embl=True),
    "genbank": lambda t: parse_features(t, embl=False),
}


# --- prepare -----------------------------------------------------------------------------------
def gather():
    records, per_file, missing = [], [], []
    for package, root, rel, fmt, lic in SOURCES:
        path = root / rel
        if not path.exists():
            missing.append(f"{package}: {path}")
            continue
        raw = list(PARSERS[fmt](_read(path)))
        kept = 0
        for ident, acc, desc, seq in raw:
            if len(seq) < MIN_LEN or not set(seq) <= AMINO:
                continue
            if sum(seq.count(c) for c in "ACGTUN") > 0.9 * len(seq):  # nucleotide, not protein
                continue
            records.append(Record(f"{package}:{rel}:{ident}", ident, acc, (desc or "").strip(), seq,
                                  package, rel, lic))
            kept += 1
        per_file.append({"package": package, "file": str(path), "format": fmt, "licence": lic,
                         "parsed": len(raw), "kept": kept})
    if missing:
        sys.exit("missing input files (apt-get install emboss-test hmmer-examples any2fasta-examples):\n  "
                 + "\n  ".join(missing))
    return records, per_file


def dedupe(records):
    by_seq = {}
    for r in sorted(records, key=lambda r: PRIORITY.index(r.licence)):  # stable: file order within a kind
        if r.seq in by_seq:
            by_seq[r.seq].also_in.append(r.name)
        else:
            by_seq[r.seq] = r
    return list(by_seq.values())


def substring_groups(records, k=8):
    """Union-find groups: a sequence that is an exact substring of another (a fragment, a Pfam
    domain of a full-length entry) goes into the same split as its parent."""
    parent = list(range(len(records)))

    def find(i):
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    index = defaultdict(set)
    for i, r in enumerate(records):
        for j in range(len(r.seq) - k + 1):
            index[r.seq[j:j + k]].add(i)
    for i, r in enumerate(records):
        for j in index.get(r.seq[:k], ()):
            if j != i and len(records[j].seq) > len(r.seq) and r.seq in records[j].seq:
                parent[find(i)] = find(j)
    groups = defaultdict(list)
    for i in range(len(records)):
        groups[find(i)].append(i)
    return sorted(groups.values(), key=lambda g: min(records[i].name for i in g))


def split(records, seed):
    groups = substring_groups(records)
    rng = random.Random(seed)
    rng.shuffle(groups)
    n = len(records)
    splits, taken = {}, 0
    for g in groups:
        if taken < TEST_FRACTION * n:
            name = "test"
        elif taken < (TEST_FRACTION + VAL_FRACTION) * n:
            name = "val"
        else:
            name = "train"
        for i in g:
            splits[records[i].name] = name
        taken += len(g)
    return splits, len(groups)


# Validation panel: record names picked by hand from the held-out (test) split of seed 0 so
# that lengths run from ~30 to >1000 and one record carries ambiguity codes (see PANEL.md).
PANEL = [
    ("emboss-test:swiss/seq.dat:FLAV_NOSSM", "shortest; Glx ambiguity (Z); held-out has no X/B/Z record"),
    ("any2fasta-examples:test.gbk.gz:WP_004750287.1", "short bacterial protein (RefSeq)"),
    ("hmmer-examples:testsuite/RRM_1.sto.gz:SXL_DROME/127-198", "single domain (RRM), ungapped Pfam seed row"),
    ("emboss-test:pir/pir1.seq:CCCA", "Asx/Glx ambiguity (B, Z); held-out has no X/B/Z record"),
    ("emboss-test:swiss/seq.dat:HBB_HUMAN", "haemoglobin beta, the classic"),
    ("emboss-test:swiss/seq.dat:FLAV_SYNP2", "small alpha/beta enzyme cofactor protein"),
    ("emboss-test:swiss/seq.dat:SSRL_TAKRU", "7-TM membrane receptor"),
    ("emboss-test:swiss/seq.dat:ACTC_TAKRU", "actin"),
    ("emboss-test:data/uniprotft.sw:AACT_HUMAN", "serpin"),
    ("emboss-test:swiss/seq.dat:PAXI_HUMAN", "disordered + LIM domains"),
    ("emboss-test:embl/inv.dat:CAC42391.1", "INSDC CDS translation"),
    ("emboss-test:swnew/trembl.dat:Q4JHL5_TAKRU", "unreviewed TrEMBL entry"),
    ("hmmer-examples:testsuite/SMC_N.sto.gz:SMC2_CHICK/2-1167", "longer than the 1022-residue training crop"),
    ("emboss-test:data/swsplit:KPB2_FUGRU", "longest (> 1000 residues)"),
]


def prepare(args):
    records, per_file = gather()
    unique = dedupe(records)
    splits, n_groups = split(unique, args.seed)
    DATA_DIR.mkdir(parents=True, exist_ok=True)
    order = sorted(unique, key=lambda r: r.name)
    with open(DATASET, "w") as f:
        for r in order:
            f.write(f">{r.name} split={splits[r.name]} acc={r.acc or '-'} licence={r.licence}\n")
            f.write("\n".join(r.seq[i:i + 60] for i in range(0, len(r.seq), 60)) + "\n")
    counts = Counter(splits.values())
    residues = Counter()
    for r in unique:
        residues[splits[r.name]] += len(r.seq)
    by_package = Counter(r.package for r in unique)
    by_licence = Counter(r.licence for r in unique)
    lengths = sorted(len(r.seq) for r in unique)
    manifest = {
        "apt_packages": {p: _deb_version(p) for p in ("emboss-test", "hmmer-examples", "any2fasta-examples")},
        "files": per_file,
        "records_parsed_and_kept": len(records),
        "unique_sequences": len(unique),
        "substring_groups": n_groups,
        "unique_by_package": dict(by_package),
        "unique_by_licence": dict(by_licence),
        "split_sequences": dict(counts),
        "split_residues": dict(residues),
        "length_min_median_max": [lengths[0], lengths[len(lengths) // 2], lengths[-1]],
        "longer_than_1022": sum(n > MAX_CROP for n in lengths),
        "dataset_sha256": hashlib.sha256(DATASET.read_bytes()).hexdigest(),
        "seed": args.seed,
        "licences": LICENCES,
    }
    MANIFEST.write_text(json.dumps(manifest, indent=1) + "\n")
    print(json.dumps({k: v for k, v in manifest.items() if k not in ("files", "licences")}, indent=1))
    if args.list_test:
        for r in order:
            if splits[r.name] == "test":
                amb = "".join(sorted(set(r.seq) - set(STANDARD)))
                print(f"{len(r.seq):5d} {amb or '-':4s} {r.name} {r.acc} {r.desc[:60]}")
    write_panel({r.name: r for r in unique}, splits)


def _deb_version(package):
    try:
        text = Path("/var/lib/dpkg/status").read_text(errors="replace")
    except OSError:
        return None
    m = re.search(rf"^Package: {re.escape(package)}\n(?:.+\n)*?Version: (.+)$", text, re.M)
    return m.group(1) if m else None


def write_panel(by_name, splits):
    if not PANEL:
        return
    fasta, rows = [], []
    for name, note in PANEL:
        r = by_name[name]
        desc = r.desc.removeprefix(r.acc).strip() if r.acc else r.desc
        fasta.append(f">{r.id} {r.acc or '-'} {desc[:70]}".rstrip())
        fasta += [r.seq[i:i + 60] for i in range(0, len(r.seq), 60)]
        amb = ",".join(sorted(set(r.seq) - set(STANDARD))) or "-"
        rows.append(f"| {r.id} | {r.acc or '-'} | {len(r.seq)} | {amb} | {splits[name]} | "
                    f"`{r.package}`: `{r.path}` | {LICENCES[r.licence].split(':')[0].split(' (')[0]} | {note} |")
    PANEL_FASTA.write_text("\n".join(fasta) + "\n")
    PANEL_MD.write_text(PANEL_HEADER + "\n".join(rows) + "\n" + PANEL_FOOTER)
    print(f"wrote {PANEL_FASTA} ({len(PANEL)} records) and {PANEL_MD}")


PANEL_HEADER = """# Validation panel

`panel.fasta` holds real public protein sequences that `esmc-mlx validate` runs through the
reference and the converted model. They were picked from the held-out 10% of the esmc-tiny
dataset (split `test` below; seed 0), so the shipped esmc-tiny never trained on them, except
where the split column says otherwise. The validation code builds the two-chain and `<mask>`
inputs from these records; they are not stored here.

Regenerate with `python scripts/train_tiny.py prepare` (needs the Debian packages
`emboss-test`, `hmmer-examples` and `any2fasta-examples`; docs/esmc-tiny.md has the details).

| id | accession | length | non-standard residues | split | source (Debian package: file) | origin / licence | why |
| --- | --- | --- | --- | --- | --- | --- | --- |
"""
PANEL_FOOTER = """
Origins and terms:

""" + "\n".join(f"- {k}: {v}" for k, v in LICENCES.items()) + """

The Debian packages that carry these files are `emboss-test` (EMBOSS licence: GPL/LGPL for the
software; the sequence records themselves come from the public databases named above),
`hmmer-examples` (GPL-3 / Janelia Farm licence for the HMMER and Easel files) and
`any2fasta-examples` (GPL-3 for the package; test.gbk is NCBI RefSeq data).
"""


# --- training ----------------------------------------------------------------------------------
def load_dataset(path):
    seqs = defaultdict(list)
    name, split_name, chunks = None, None, []
    for line in open(path).read().splitlines() + [">"]:
        if line.startswith(">"):
            if name is not None:
                seqs[split_name].append((name, "".join(chunks)))
            if line == ">":
                break
            head = line[1:].split()
            name, split_name, chunks = head[0], dict(kv.split("=", 1) for kv in head[1:])["split"], []
        else:
            chunks.append(line.strip())
    return seqs


def train(args):
    import numpy as np
    import torch
    import torch.nn.functional as F
    import transformers
    from transformers import EsmcConfig, EsmcForMaskedLM, EsmcTokenizer

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    t_start = time.time()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.use_deterministic_algorithms(True, warn_only=True)
    device = torch.device(args.device)

    tokenizer = EsmcTokenizer()
    vocab = tokenizer.get_vocab()
    CLS, PAD, EOS, MASK = (vocab[t] for t in ("<cls>", "<pad>", "<eos>", "<mask>"))
    aa_ids = torch.tensor([vocab[c] for c in STANDARD])
    lut = np.full(256, vocab["<unk>"], dtype=np.int64)
    for c in AMINO:
        lut[ord(c)] = vocab[c]

    def encode(seq):
        return lut[np.frombuffer(seq.encode(), dtype=np.uint8)]

    data = load_dataset(args.data)
    enc = {k: [encode(s) for _, s in v] for k, v in data.items()}
    print({k: (len(v), int(sum(len(x) for x in v))) for k, v in enc.items()}, flush=True)

    config = EsmcConfig(
        vocab_size=64, hidden_size=args.hidden, num_attention_heads=args.heads,
        num_hidden_layers=args.layers, intermediate_size=args.intermediate,
        max_position_embeddings=2048, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    model = EsmcForMaskedLM(config).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"transformers {transformers.__version__} torch {torch.__version__} device {device} "
          f"params {n_params}", flush=True)

    def batch_tensor(chunks):
        L = -(-(max(len(c) for c in chunks) + 2) // 32) * 32  # few distinct shapes: kernels tune once
        ids = torch.full((len(chunks), L), PAD, dtype=torch.long)
        for i, c in enumerate(chunks):
            ids[i, 0] = CLS
            ids[i, 1:len(c) + 1] = torch.from_numpy(c)
            ids[i, len(c) + 1] = EOS
        return ids

    def mlm_mask(ids, gen):
        """Standard BERT masking: 15% of residue positions; 80% <mask>, 10% random residue, 10% kept."""
        residue = (ids != PAD) & (ids != CLS) & (ids != EOS)
        picked = (torch.rand(ids.shape, generator=gen) < 0.15) & residue
        labels = torch.where(picked, ids, torch.full_like(ids, -100))
        roll = torch.rand(ids.shape, generator=gen)
        inputs = ids.clone()
        inputs[picked & (roll < 0.8)] = MASK
        rand = picked & (roll >= 0.8) & (roll < 0.9)
        inputs[rand] = aa_ids[torch.randint(len(aa_ids), ids.shape, generator=gen)][rand]
        return inputs, labels

    def batches(rng):
        """One epoch of random crops (<= 1022 residues), length-bucketed into token-budget batches."""
        order = rng.permutation(len(enc["train"]))
        crops = []
        for i in order:
            s = enc["train"][i]
            if len(s) > args.crop:
                o = rng.integers(0, len(s) - args.crop + 1)
                s = s[o:o + args.crop]
            crops.append(s)
        out_batches = []
        pool = 4096
        for p in range(0, len(crops), pool):
            chunk = sorted(crops[p:p + pool], key=len)
            cur = []
            for c in chunk:
                if cur and (len(cur) + 1) * (max(len(cur[-1]), len(c)) + 2) > args.batch_tokens:
                    out_batches.append(cur)
                    cur = []
                cur.append(c)
            if cur:
                out_batches.append(cur)
        rng.shuffle(out_batches)
        return out_batches

    def eval_chunks(split_name):
        chunks = []
        for s in enc[split_name]:
            for o in range(0, len(s), args.crop):
                chunks.append(s[o:o + args.crop])
        return sorted(chunks, key=len)

    unigram_counts = torch.zeros(64, dtype=torch.float64)
    for s in enc["train"]:
        unigram_counts += torch.bincount(torch.from_numpy(s), minlength=64).double()
    residue_ids = sorted({vocab[c] for c in AMINO})
    unigram = torch.zeros(64, dtype=torch.float64)
    unigram[residue_ids] = unigram_counts[residue_ids] + 1.0  # add-one over the 25 residue tokens
    unigram_logp = (unigram / unigram.sum()).clamp_min(1e-30).log()

    @torch.no_grad()
    def evaluate(split_name, passes, max_tokens=32768):
        """Masked-LM cross-entropy: residues are split into `passes` disjoint, seeded folds; each
        fold is replaced by <mask> in one forward pass, so every residue is scored exactly once
        when passes = 7 (~14% masked per pass)."""
        model.eval()
        chunks = eval_chunks(split_name)
        gen = torch.Generator().manual_seed(1234)
        nll = nll_uni = correct = count = 0.0
        i = 0
        while i < len(chunks):
            j = i
            while j < len(chunks) and (j - i + 1) * (len(chunks[j]) + 2) <= max_tokens:
                j += 1
            j = max(j, i + 1)
            ids = batch_tensor(chunks[i:j])
            residue = (ids != PAD) & (ids != CLS) & (ids != EOS)
            fold = torch.randint(7, ids.shape, generator=gen)
            attn = (ids != PAD).long().to(device)
            for p in range(passes):
                picked = residue & (fold == p)
                if not picked.any():
                    continue
                inputs = torch.where(picked, torch.full_like(ids, MASK), ids).to(device)
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                    logits = model(input_ids=inputs, attention_mask=attn).logits
                logp = F.log_softmax(logits.float(), dim=-1)
                pk = picked.to(device)
                tgt = ids.to(device)[pk]
                lp = logp[pk]
                nll += -lp.gather(1, tgt[:, None]).sum().item()
                correct += (lp.argmax(-1) == tgt).sum().item()
                nll_uni += -unigram_logp[tgt.cpu()].sum().item()
                count += tgt.numel()
            i = j
        model.train()
        return {"masked_residues": int(count), "cross_entropy": nll / count, "perplexity": math.exp(nll / count),
                "accuracy": correct / count, "unigram_cross_entropy": nll_uni / count,
                "unigram_perplexity": math.exp(nll_uni / count)}

    def make_optimizer(m):
        decay = [p for n, p in m.named_parameters() if p.dim() >= 2 and "embed" not in n]
        no_decay = [p for n, p in m.named_parameters() if not (p.dim() >= 2 and "embed" not in n)]
        return torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                                  {"params": no_decay, "weight_decay": 0.0}],
                                 lr=args.lr, betas=(0.9, 0.98), eps=1e-8,
                                 **({"fused": True} if device.type == "cuda" else {}))

    def train_step(m, opt, chunks, lr, gen):
        ids = batch_tensor(chunks)
        inputs, labels = mlm_mask(ids, gen)
        attn = (ids != PAD).long()
        n_tokens = int(attn.sum())  # counted on the host: no device sync
        inputs, labels, attn = inputs.to(device), labels.to(device), attn.to(device)
        for g in opt.param_groups:
            g["lr"] = lr
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits = m(input_ids=inputs, attention_mask=attn).logits
        loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels.view(-1), ignore_index=-100)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        opt.step()
        return loss, gnorm, n_tokens

    opt = make_optimizer(model)

    def lr_at(step):
        if step < args.warmup:
            return args.lr * (step + 1) / args.warmup
        t = (step - args.warmup) / max(1, args.steps - args.warmup)
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))

    rng = np.random.default_rng(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    history, best, best_state, step, epoch = [], None, None, 0, 0
    train_tokens, t_train = 0, time.time()
    stopped_by = "steps"
    model.train()
    while step < args.steps:
        epoch += 1
        for chunks in batches(rng):
            if step >= args.steps:
                break
            if time.time() - t_train > args.max_train_seconds:
                stopped_by = "time"
                break
            loss, gnorm, n_tokens = train_step(model, opt, chunks, lr_at(step), gen)
            step += 1
            train_tokens += n_tokens
            if step % args.log_every == 0:
                print(f"step {step} epoch {epoch} loss {loss.item():.4f} gnorm {gnorm.item():.2f} "
                      f"lr {lr_at(step):.2e} tokens {train_tokens} {time.time() - t_train:.0f}s", flush=True)
            if step % args.eval_every == 0 or step == args.steps:
                val = evaluate("val", passes=2)
                history.append({"step": step, "epoch": epoch, "train_loss": loss.item(), "val": val,
                                "seconds": time.time() - t_train})
                print(f"  val step {step}: ce {val['cross_entropy']:.4f} ppl {val['perplexity']:.3f} "
                      f"acc {val['accuracy']:.3f}", flush=True)
                if best is None or val["cross_entropy"] < best["val"]["cross_entropy"]:
                    best = history[-1]
                    best_state = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
        if stopped_by == "time":
            break
    train_seconds = time.time() - t_train
    if best_state is None or (history and history[-1]["step"] != step):
        val = evaluate("val", passes=2)
        history.append({"step": step, "epoch": epoch, "val": val, "seconds": train_seconds})
        if best is None or val["cross_entropy"] < best["val"]["cross_entropy"]:
            best = history[-1]
            best_state = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
    model.load_state_dict(best_state)
    model.float()

    results = {split_name: evaluate(split_name, passes=7) for split_name in ("test", "val")}
    results["train_one_fold"] = evaluate("train", passes=1)  # ~14% of training residues: overfit gauge
    print(json.dumps(results, indent=1), flush=True)

    model.cpu().save_pretrained(out)
    tokenizer.save_pretrained(out)
    size = (out / "model.safetensors").stat().st_size
    metrics = {
        "command": " ".join(sys.argv),
        "reproduce": f"python scripts/train_tiny.py train --device {args.device} --out OUT --steps {step}"
                     f" --seed {args.seed}  (other settings: hyperparameters below)",
        "transformers": transformers.__version__, "torch": torch.__version__,
        "device": (torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu"),
        "dataset_sha256": hashlib.sha256(Path(args.data).read_bytes()).hexdigest(),
        "split_sequences": {k: len(v) for k, v in enc.items()},
        "split_residues": {k: int(sum(len(x) for x in v)) for k, v in enc.items()},
        "params": n_params, "model_safetensors_bytes": size,
        "hyperparameters": {k: v for k, v in vars(args).items() if k not in ("func",)},
        "steps_run": step, "epochs_started": epoch, "stopped_by": stopped_by,
        "train_tokens": train_tokens, "train_seconds": train_seconds,
        "best_step": best["step"], "history": history,
        "test": results["test"], "val": results["val"], "train_one_fold": results["train_one_fold"],
        "total_seconds": time.time() - t_start,
    }
    (out / "metrics.json").write_text(json.dumps(metrics, indent=1) + "\n")
    (out / "README.md").write_text(model_card(metrics))
    print(f"wrote {out} (model.safetensors {size / 1e6:.1f} MB)", flush=True)


def model_card(m):
    t, h = m["test"], m["hyperparameters"]
    return f"""---
license: apache-2.0
library_name: transformers
pipeline_tag: fill-mask
tags:
- esmc
- protein-language-model
- esmc-mlx
---

# esmc-tiny

A small ESMC (transformers `EsmcForMaskedLM`: {h['layers']} layers, hidden {h['hidden']}, {h['heads']} heads
of 64, SwiGLU {h['intermediate']}, vocabulary 64; {m['params']:,} parameters, float32) trained by
esmc-mlx with masked-language modelling on {sum(m['split_sequences'].values())} real public protein
sequences shipped as files by the Debian packages `emboss-test`, `hmmer-examples` and
`any2fasta-examples` (UniProtKB/Swiss-Prot and TrEMBL entries, INSDC and NCBI RefSeq CDS
translations, PIR-PSD, WormBase wormpep, Pfam seed alignments, ungapped). It is the model that
`esmc-convert tiny` converts offline: a real trained network for tests, demos and the quality
side of validation (quantization error on trained weights), not a model for biology.

- Training: {m['steps_run']} steps (best validation at step {m['best_step']}), {m['train_tokens']:,} tokens,
  AdamW lr {h['lr']}, weight decay {h['weight_decay']}, {h['batch_tokens']} tokens a batch, crops of at most
  {h['crop']} residues, 15% masking (80% `<mask>`, 10% random residue, 10% kept), seed {h['seed']},
  on {m['device']} with bf16 autocast, transformers {m['transformers']}, torch {m['torch']}.
- Held-out test split ({m['split_sequences']['test']} sequences, {t['masked_residues']} residues, every residue
  masked once): cross-entropy {t['cross_entropy']:.4f} nats, **perplexity {t['perplexity']:.2f}** against
  {t['unigram_perplexity']:.2f} for the unigram residue frequencies of the training split;
  top-1 accuracy {t['accuracy']:.3f}. The split is by sequence (exact duplicates removed, exact
  substrings kept with their parent), not by homology: families such as globins, cytochromes c
  and the Pfam seeds have members on both sides, so the figure flatters unseen families.

Licence: the weights are released under Apache-2.0, like esmc-mlx. The training sequences come
from UniProtKB (CC BY 4.0, attribution: The UniProt Consortium), Pfam (CC0), INSDC and NCBI
RefSeq (no restrictions), PIR-PSD and WormBase (freely available). esmc-tiny is not affiliated
with EvolutionaryScale's or Biohub's ESMC models and contains none of their weights.

How it was made: `scripts/train_tiny.py` in the esmc-mlx repository; figures and data
provenance: `docs/esmc-tiny.md`.
"""


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(required=True)
    p = sub.add_parser("prepare", help="gather, dedupe and split the sequences; write the panel")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--list-test", action="store_true", help="print the held-out records")
    p.set_defaults(func=prepare)
    t = sub.add_parser("train", help="train esmc-tiny on the prepared dataset")
    t.add_argument("--data", default=str(DATASET))
    t.add_argument("--out", required=True)
    t.add_argument("--device", default="cpu")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--hidden", type=int, default=256)
    t.add_argument("--heads", type=int, default=4)
    t.add_argument("--layers", type=int, default=6)
    t.add_argument("--intermediate", type=int, default=768)
    t.add_argument("--steps", type=int, default=4500)
    t.add_argument("--warmup", type=int, default=300)
    t.add_argument("--lr", type=float, default=1e-3)
    t.add_argument("--weight-decay", type=float, default=0.05)
    t.add_argument("--batch-tokens", type=int, default=16384)
    t.add_argument("--crop", type=int, default=MAX_CROP)
    t.add_argument("--eval-every", type=int, default=250)
    t.add_argument("--log-every", type=int, default=50)
    t.add_argument("--max-train-seconds", type=float, default=1e9,
                   help="safety stop; the run records where it stopped (rerun with --steps N to reproduce)")
    t.set_defaults(func=train)
    args = ap.parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
