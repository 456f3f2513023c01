"""The ground floor: what every room reads and none owns. The config loader (recipes, overrides, the
registered sections), plain values checked against dataclass types, torchvision on a CPU-only torch,
the signals that stop a run, how every process of a run ends with its parent, the exit codes, YAML
from untrusted files and URLs printed without their secrets. Imports nothing of visiontrain above it
(``config`` loads the catalogue at call time)."""
