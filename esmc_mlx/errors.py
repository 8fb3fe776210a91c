"""Every exception esmc-mlx raises on purpose, as one tree (as huggingface_hub's ``errors.py``).

The CLI prints an ``EsmcMlxError``'s message as one ``Error:`` line and exits non-zero; nothing
else is printed. Messages name the file, tensor, option or sequence at fault. Classes whose
errors callers may catch as ``ValueError`` are ``ValueError``s too.
"""


class EsmcMlxError(Exception):
    """Base class: a problem with the user's input or environment, explained in the message."""


class ConfigError(EsmcMlxError, ValueError):
    """A model config that is missing fields or contradicts itself or the tensors."""


class ConvertError(EsmcMlxError):
    """A source or output that cannot be converted (missing, damaged, contradictory)."""


class QuantizeError(EsmcMlxError):
    """A quantization spec or group size that does not apply."""


class HubError(EsmcMlxError):
    """A Hub request that failed (auth, permissions, network, offline mode)."""


class SequenceError(EsmcMlxError, ValueError):
    """A protein sequence (or FASTA file) that ESMC cannot read: characters outside its vocabulary,
    empty records, malformed FASTA. The tokenizer and the FASTA reader raise the same class."""


# The names the tokenizer and the FASTA reader used before they shared one validator.
TokenizerError = SequenceError
FastaError = SequenceError


class MutationError(EsmcMlxError):
    """A mutant string that is malformed or does not fit the wild-type sequence."""


class ScoringError(EsmcMlxError):
    """Bad arguments to a scoring or embedding job (layer, method, batch size)."""


class JobError(EsmcMlxError):
    """An output directory or input file that a job cannot use as asked."""


class FoldError(EsmcMlxError, ValueError):
    """A structure prediction that cannot run as asked: a chain the fold does not take (empty,
    characters outside the 20 amino acids and X, a nucleic acid, a ligand), sampling settings that
    do not apply, or a structure a file format cannot hold."""


class ValidationError(EsmcMlxError):
    """Validation could not run as asked (bad threshold name, unreadable reference ...)."""


class OutputError(ConvertError, JobError):
    """An output path that cannot be written as asked: it exists, holds files esmc-mlx did not
    write, is locked by another run, contains the input, or the disk is full. A ConvertError
    (for the converter's callers) and a JobError (for the jobs') alike."""


class EsmcMlxWarning(UserWarning):
    """Something the user should know that does not stop the work (a sequence longer than the
    model was trained on, stale files of a dead run removed). The CLI prints it as one
    ``Warning:`` line."""


TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def install_hint(extra: str) -> str:
    """How to install esmc-mlx's optional ``extra`` where esmc-mlx came from a clone or a wheel
    (it is not on PyPI, so ``pip install 'esmc-mlx[plot]'`` finds nothing): the extra's own
    requirements, read from the installed package's metadata (pyproject.toml, one place). On
    Linux without an NVIDIA GPU, torch's CPU build, as `make install` takes it."""
    import shutil
    import sys
    from importlib import metadata

    from packaging.requirements import Requirement

    try:
        declared = metadata.requires("esmc-mlx") or []
    except metadata.PackageNotFoundError:  # run from a source tree that was never installed
        declared = []
    wanted = []
    for text in declared:
        marker = Requirement(text).marker
        if marker is not None and marker.evaluate({"extra": extra}) and not marker.evaluate({"extra": ""}):
            wanted.append(text.partition(";")[0].strip())
    if not wanted:
        return f"pip install '.[{extra}]' in esmc-mlx's source"
    cpu_torch = sys.platform == "linux" and shutil.which("nvidia-smi") is None
    index = f" --extra-index-url {TORCH_CPU_INDEX}" if cpu_torch and any(w.startswith("torch") for w in wanted) else ""
    return f"pip install {' '.join(repr(w) for w in wanted)}{index} (esmc-mlx's {extra} extra)"
