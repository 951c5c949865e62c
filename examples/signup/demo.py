"""End-to-end demo: a sign-up survives a subscriber outage and a SIGKILL of the publisher.

1. the web and email services start; the email service subscribes to ``user.signup``;
2. three sign-ups: three welcome emails;
3. the email service is stopped; five more sign-ups are published and queued on disk;
4. the web service is killed with SIGKILL, before it could deliver anything;
5. both restart: the five queued sign-ups arrive, and every email was sent exactly once.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

from servicebus.testing import free_address, wait_until

HERE = Path(__file__).resolve().parent
DATA = HERE / "data"
OUTBOX = HERE / "out" / "emails.txt"


class Service:
    def __init__(self, name: str, script: str, *args: str) -> None:
        self.name, self.cmd = name, [sys.executable, str(HERE / script), *args]
        self.proc: subprocess.Popen | None = None
        self.log = open(DATA / f"{name}.log", "ab")

    def start(self) -> str:
        self.proc = subprocess.Popen(self.cmd, cwd=HERE, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, text=True)
        return self.expect("ready")

    def expect(self, word: str) -> str:
        line = self.proc.stdout.readline()
        if not line.startswith(word):
            raise SystemExit(f"{self.name} did not say {word!r} (got {line!r}); see {self.log.name}")
        return line.split(maxsplit=1)[1].strip()

    def send(self, line: str) -> str:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return self.expect("published")

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.stdin.close()
        self.proc.wait(30)

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)


def emails() -> list[str]:
    return OUTBOX.read_text().splitlines() if OUTBOX.exists() else []


def main() -> int:
    shutil.rmtree(DATA, ignore_errors=True)
    shutil.rmtree(OUTBOX.parent, ignore_errors=True)
    DATA.mkdir(parents=True)
    web_addr, email_addr = free_address(), free_address()
    web = Service("web", "web.py", "--bind", web_addr, "--data", str(DATA / "web"))
    email = Service("email", "email_service.py", "--web", web_addr, "--bind", email_addr,
                    "--data", str(DATA / "email"), "--outbox", str(OUTBOX))
    say = lambda text: print(text, flush=True)  # noqa: E731
    try:
        web.start()
        email.start()
        say(f"[1] web service up at {web_addr}; email service up and subscribed to user.signup")
        for user in ("ada", "brian", "carol"):
            web.send(f"{user}@example.com")
        wait_until(lambda: len(emails()) == 3, 20, message="3 emails")
        say("[2] 3 sign-ups published -> 3 welcome emails sent")

        email.stop()
        say("[3] email service stopped")
        pending = ""
        for user in ("dan", "eve", "frank", "grace", "heidi"):
            pending = web.send(f"{user}@example.com").rsplit("pending=", 1)[1]
        say(f"[4] 5 sign-ups published while it is down: the web service holds {pending} "
            "undelivered messages, fsynced on disk")
        web.kill()
        say("[5] web service killed with SIGKILL (no shutdown, nothing flushed by hand)")

        web.start()
        email.start()
        say("[6] web and email services restarted")
        wait_until(lambda: len(emails()) == 8, 30, message="8 emails")
        sent = Counter(line.split()[2] for line in emails())
        duplicates = sorted(k for k, v in sent.items() if v > 1)
        say(f"[7] the queued sign-ups arrived: {len(sent)} welcome emails for 8 sign-ups, "
            f"{'each sent exactly once' if not duplicates else f'DUPLICATES: {duplicates}'}")
        for line in emails():
            say(f"      {line.split(maxsplit=1)[1]}")
        return 0 if len(sent) == 8 and not duplicates else 1
    finally:
        for service in (web, email):
            if service.proc and service.proc.poll() is None:
                service.stop()


if __name__ == "__main__":
    sys.exit(main())
