"""The command line: parsing and exit codes (``cli``), what each command does (``commands``),
starting a command's processes (``launch``) and ``visiontrain benchmark``. The top room: it may
import every other."""
