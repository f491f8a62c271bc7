"""Files copied into an exported Hugging Face checkpoint (loaded with trust_remote_code).

They import ``modbench`` to build the exact same model, so every registered method exports;
the loading environment needs ``pip install modbench``.
"""
