"""Train a GPT. With no arguments: the small CPU model on the embedded Shakespeare corpus.

    python train.py --config configs/book-gpt2.yaml --trainer.max_steps 100   # a whole run
    python train.py --print_config
    python train.py --ckpt_path last          # resume the run exactly where it stopped
"""

import sys

from gptmini.threads import sleep_when_idle

sleep_when_idle()  # before torch loads OpenMP: a shared CPU keeps its fair share

from gptmini.train.command import keep_freed_memory, main  # noqa: E402

if __name__ == "__main__":
    keep_freed_memory()  # process-wide: set here, in the training process, not by the library
    sys.exit(main(own_signals=True))  # this process is train.py's: signals end it with a code
