"""ESMFold2 structure prediction: featurization, the diffusion sampler, structure files."""
