"""Generate text from a gptmini checkpoint or a local GPT-2 directory.

    python generate.py --checkpoint runs/.../last.ckpt --prompt "ROMEO:" --stream

All the logic is in `gptmini.generate.command.generate_main`; `python generate.py -h` lists
the options.
"""

from gptmini.threads import sleep_when_idle

sleep_when_idle()  # before torch loads OpenMP: a shared CPU keeps its fair share

from gptmini.generate.command import generate_main as main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
