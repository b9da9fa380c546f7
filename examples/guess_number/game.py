"""Number guessing: a multi-turn environment scored at every turn (process rewards).

The agent guesses a secret integer in [low, high]; after each guess the environment answers ``higher``,
``lower`` or ``correct``. Each guess earns a step reward:

- ``1.0`` for the right number;
- for a wrong guess inside the range still possible, half the fraction of that range it rules out
  (a binary-search guess earns about 0.25, a guess at an edge almost nothing);
- ``-0.1`` for a guess that is not a number or falls outside what is still possible (it teaches nothing).

The trajectory reward is ``1.0`` if the number was found within the turn limit. The environment never sees the
model: the agent loop (agent.py) passes the reply text in and the feedback out.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass
class Turn:
    feedback: str  # what the agent is told next
    reward: float  # the step reward of this guess
    done: bool
    guess: int | None


class GuessNumberEnv:
    def __init__(self, secret: int, low: int = 1, high: int = 64, max_turns: int = 8) -> None:
        assert low <= secret <= high
        self.secret, self.low, self.high, self.max_turns = secret, low, high, max_turns
        self.lo, self.hi = low, high  # the range still consistent with the feedback so far
        self.turns = 0
        self.solved = False

    def intro(self) -> str:
        return (
            f"I am thinking of an integer between {self.low} and {self.high}. Guess it: answer with one "
            f"number. I will say higher, lower or correct."
        )

    def step(self, reply: str | None) -> Turn:
        self.turns += 1
        out_of_turns = self.turns >= self.max_turns
        match = re.search(r"-?\d+", reply or "")
        guess = int(match.group()) if match else None
        if guess is None or not self.lo <= guess <= self.hi:
            why = "That is not a number." if guess is None else f"It is between {self.lo} and {self.hi}."
            return Turn(f"{why} Guess again.", -0.1, out_of_turns, guess)
        if guess == self.secret:
            self.solved = True
            return Turn("Correct!", 1.0, True, guess)
        size = self.hi - self.lo + 1
        if guess < self.secret:
            self.lo = guess + 1
            feedback = "Higher."
        else:
            self.hi = guess - 1
            feedback = "Lower."
        ruled_out = 1.0 - (self.hi - self.lo + 1) / size
        return Turn(feedback, round(0.5 * ruled_out, 4), out_of_turns, guess)

    def binary_search_guess(self) -> int:
        """The optimal next guess (used by ``--scripted`` runs)."""
        return (self.lo + self.hi) // 2
