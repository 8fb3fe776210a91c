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
