"""Draw attention maps and training curves as PNGs (needs `pip install 'gptmini[plot]'`).

    python visualize.py attention --checkpoint runs/shakespeare-cpu/checkpoints/best.ckpt \
        --prompt "ROMEO: But soft, what light" --all_heads --out attention.png
    python visualize.py curves runs/shakespeare-cpu --out curves.png
"""

import sys

from gptmini.analysis.visualize import visualize_main as main

if __name__ == "__main__":
    sys.exit(main())
