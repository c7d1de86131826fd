import subprocess
import sys


def test_import_needs_neither_sglang_nor_cuda():
    code = (
        "import sys, dflash_sglang, dflash_sglang.core.reference, dflash_sglang.cli;"
        "import torch;"
        "assert not any(m == 'sglang' or m.startswith('sglang.') for m in sys.modules), 'sglang imported';"
        "assert not torch.cuda.is_initialized(), 'CUDA initialised at import'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
