"""FoldConfig reads transformers' EsmFold2Config spelling, None values included."""

from __future__ import annotations

import copy

from esmc_mlx.fold_config import FoldConfig
from esmc_mlx.testing import tiny_fold_config


def test_none_is_kept_where_transformers_reads_it_as_a_value():
    raw = copy.deepcopy(tiny_fold_config(chunk_size=None))
    raw["structure_head"]["inference_sigma_cap"] = None
    raw["structure_head"]["diffusion_module"]["head_dim"] = None
    config = FoldConfig.from_dict(raw)
    assert config.chunk_size is None  # no chunking, not the default 64
    assert config.structure_head.inference_sigma_cap is None  # no cap, not the default 256
    assert config.structure_head.diffusion_module.head_dim == 64 // 4  # None: derived from the width
    again = FoldConfig.from_dict(config.to_dict())
    assert again == config
    assert FoldConfig.from_dict(tiny_fold_config()).structure_head.inference_sigma_cap == 256.0
