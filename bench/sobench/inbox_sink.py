"""Fallback sink: sendonce's aiosmtpd inbox, printing smtp-sink-style counters (``mesg=N``)."""

from __future__ import annotations

import signal
import sys
import threading

from sendonce.testing.inbox import Inbox


def main() -> None:
    port = int(sys.argv[1])
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    with Inbox(host="127.0.0.1", port=port) as inbox:
        last = -1
        while not done.wait(0.2):
            inbox.clear()  # only the count matters here; accepted_total keeps it
            if inbox.accepted_total != last:
                last = inbox.accepted_total
                sys.stdout.write(f"mesg={last}\r")
                sys.stdout.flush()
        sys.stdout.write(f"mesg={inbox.accepted_total}\r")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
