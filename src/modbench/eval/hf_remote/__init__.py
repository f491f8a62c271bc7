"""The two remote-code files of an exported Hugging Face checkpoint (loaded with
trust_remote_code), copied into the export as they are.

``modeling_modbench.py`` imports the modbench modules that :mod:`modbench.eval.hf_bundle`
writes next to it (``modbench_*.py``), not ``modbench`` itself, so these two files are not
importable from here: they are templates, linted with the package.
"""
