"""Serve a gptmini checkpoint with an OpenAI-compatible completions API.

    python serve.py --checkpoint runs/shakespeare-cpu/checkpoints/last.ckpt --port 8000

All the logic is in `gptmini.serve.command.serve_main` and `gptmini.serve.app`; `python serve.py -h`
lists the options. Needs the serve extra: pip install -e '.[serve]'.
"""

from gptmini.threads import sleep_when_idle

sleep_when_idle()  # before torch loads OpenMP: the event loop and the clients keep a core

from gptmini.serve.command import serve_main as main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
