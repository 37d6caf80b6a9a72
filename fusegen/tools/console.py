"""What fusegen's commands share on the console: the one-line argument error and the build
progress line (`fusegen EXPR` and `fusegen bench` draw it)."""

from __future__ import annotations

import argparse
import logging
import sys
import threading
import time


class Parser(argparse.ArgumentParser):
    """argparse, but an error is one line, `fusegen: error: <what>`, exit status 2 (argparse
    prints the whole usage first, which buries the message)."""

    hint = ""

    def error(self, message):
        self.exit(2, f"fusegen: error: {message} (see `{self.prog} --help`{self.hint})\n")


class Progress(logging.Handler):
    """The CLI's view of the "fusegen" logger. build/builder.py marks its records with
    `fusegen_build` = start / done / failed / wait. On a terminal (stderr), a build is one
    line, `building op(s) fma for CPU... 2.3 s`, redrawn by a ticker thread and finished with
    the outcome; elsewhere each message is a plain line on stdout (a log file, CI)."""

    TICK = 0.2  # seconds between redraws

    def __init__(self, live: bool, stream):
        super().__init__(logging.INFO)
        self.live, self.stream = live, stream
        self.builds: list[tuple[str, float]] = []  # (message, start): nested builds stack up
        self.drawn = False  # a live line is on screen, without its newline
        self.guard = threading.Lock()
        self.stop = threading.Event()
        self.ticker: threading.Thread | None = None
        self.saved = (logging.NOTSET, True)  # the logger's level and propagate, restored after

    @classmethod
    def install(cls) -> "Progress":
        live = sys.stderr.isatty()
        handler = cls(live, sys.stderr if live else sys.stdout)
        logger = logging.getLogger("fusegen")
        handler.saved = (logger.level, logger.propagate)
        logger.setLevel(logging.INFO)
        logger.propagate = False  # the messages are shown here, not twice through root
        logger.addHandler(handler)
        return handler

    def uninstall(self):
        logger = logging.getLogger("fusegen")
        logger.removeHandler(self)
        logger.setLevel(self.saved[0])
        logger.propagate = self.saved[1]
        self.stop.set()
        if self.ticker is not None:
            self.ticker.join()
        with self.guard:
            self._end_line()

    def emit(self, record: logging.LogRecord):
        try:
            message = record.getMessage()
            event = getattr(record, "fusegen_build", None)
            with self.guard:
                if not self.live:
                    self._write(message + ("..." if event == "start" else "") + "\n")
                elif event == "start":
                    sys.stdout.flush()  # the summary printed so far comes first
                    self._end_line()
                    self.builds.append((message, time.monotonic()))
                    self._draw()
                    self._start_ticker()
                elif event in ("done", "failed", "interrupted") and self.builds:
                    text, start = self.builds.pop()
                    outcome = "" if event == "done" else f" {event}"
                    self._write(f"\r\033[K{text}... {time.monotonic() - start:.1f} s{outcome}\n")
                    self.drawn = False
                    self._draw()  # the outer build, if this one was nested in it
                else:
                    self._end_line()
                    self._write(message + "\n")
                    self._draw()
        except Exception:  # a broken terminal must not break the build
            self.handleError(record)

    def _write(self, text: str):
        self.stream.write(text)
        self.stream.flush()

    def _draw(self):
        if self.builds:
            text, start = self.builds[-1]
            self._write(f"\r\033[K{text}... {time.monotonic() - start:.1f} s")
            self.drawn = True

    def _end_line(self):
        if self.drawn:
            self._write("\n")
            self.drawn = False

    def _start_ticker(self):
        if self.ticker is not None:
            return

        def tick():
            while not self.stop.wait(self.TICK):
                with self.guard:
                    if self.builds:
                        self._draw()

        self.ticker = threading.Thread(target=tick, name="fusegen-progress", daemon=True)
        self.ticker.start()
