"""The Tinker face: its routes beside the operations they call (training, sampling, checkpoints, the mindlab-toolkit extensions) and the wire codec."""
