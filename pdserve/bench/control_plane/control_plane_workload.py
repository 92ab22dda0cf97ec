"""What the synthetic workers of `bench control-plane` hold, and the prompts the router routes.

A pure function of its settings and seed. Two layouts:
  conversations  a few system prompts, each the start of many conversations and so cached on
                 many workers; conversation histories (a system prompt followed by the
                 conversation's own turns) cached on their worker and, for some, on one or two
                 more (a conversation that moved);
  tenants        issue 50's multi-tenant workload as prefix-aware routing leaves it: many
                 tenants, each a long shared prefix with a few users' short conversations
                 behind it, every tenant's conversations kept on the tenant's 1-3 home workers
                 (routing follows the prefix), so a prefix is held where its users are.
Conversations are added until the index would hold `target_blocks` distinct blocks. Every token list is regenerated from (seed, name) wherever it
is needed, so the plan itself stays small enough to hand to the fill processes.
"""

from __future__ import annotations

import random
from array import array
from dataclasses import dataclass, field

FIRST_TOKEN = 3  # below: BOS, EOS, PAD of pdserve's built-in tokenizer
LAYOUTS = ("conversations", "tenants")


@dataclass(frozen=True)
class PlanSettings:
    workers: int = 256
    prefill_workers: int = 64  # the first ones; the rest decode
    target_blocks: int = 1_000_000  # distinct blocks in the index
    block_size: int = 16
    prompt_tokens: int = 4096  # length of every routed prompt
    system_prompts: int = 64
    system_tokens: int = 1024
    min_history_tokens: int = 512  # a conversation's own tokens after its system prompt
    extra_holders: tuple[float, float] = (0.5, 0.1)  # P(on a 2nd worker), P(on a 3rd worker)
    vocab_size: int = 4096
    seed: int = 0
    layout: str = "conversations"  # or "tenants" (the module docstring)

    def __post_init__(self) -> None:
        if not 0 <= self.prefill_workers < self.workers:
            raise ValueError("need 0 <= prefill_workers < workers")
        if self.system_tokens % self.block_size or self.min_history_tokens % self.block_size:
            raise ValueError("system_tokens and min_history_tokens must be whole blocks")
        if self.system_tokens + self.min_history_tokens >= self.prompt_tokens:
            raise ValueError("prompt_tokens must exceed system_tokens + min_history_tokens")
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {self.layout!r}")


@dataclass(frozen=True)
class Conversation:
    index: int
    system: int  # which system prompt it starts with
    history_tokens: int  # its own tokens after the system prompt (whole blocks)
    holders: tuple[int, ...]  # workers that cache it, the first is where it lives


@dataclass
class IndexPlan:
    settings: PlanSettings
    conversations: list[Conversation] = field(default_factory=list)

    @classmethod
    def build(cls, settings: PlanSettings) -> IndexPlan:
        s = settings
        rng = random.Random(f"plan:{s.seed}")
        plan = cls(s)
        # Conversations' histories run from min_history_tokens up to the routed prompt's length
        # minus a new turn of at least one block.
        longest = (s.prompt_tokens - s.system_tokens) // s.block_size - 1
        shortest = s.min_history_tokens // s.block_size
        workers = list(range(s.workers))
        homes: dict[int, list[int]] = {}  # tenants: system prompt -> its home workers
        blocks = 0
        while blocks < s.target_blocks:
            system = rng.randrange(s.system_prompts)
            if system not in homes:
                tenant = s.layout == "tenants"
                homes[system] = _holders(rng, workers, s.extra_holders) if tenant else []
                blocks += s.system_tokens // s.block_size
            history = rng.randint(shortest, longest)
            if s.layout == "tenants":  # on one of its tenant's homes, some on two
                holders = _holders(rng, homes[system], (s.extra_holders[0],))
            else:
                holders = _holders(rng, workers, s.extra_holders)
            conv = Conversation(len(plan.conversations), system, history * s.block_size,
                                tuple(holders))  # fmt: skip
            plan.conversations.append(conv)
            blocks += history
        return plan

    @property
    def distinct_blocks(self) -> int:
        s = self.settings
        systems = {c.system for c in self.conversations}
        return len(systems) * s.system_tokens // s.block_size + sum(
            c.history_tokens // s.block_size for c in self.conversations
        )

    def worker_id(self, worker: int) -> str:
        return f"worker-{worker}"

    def role(self, worker: int) -> str:
        return "prefill" if worker < self.settings.prefill_workers else "decode"

    def held_by(self, worker: int) -> list[Conversation]:
        return [c for c in self.conversations if worker in c.holders]

    def held_blocks(self, worker: int) -> int:
        """Distinct blocks `worker` caches once it computed all its conversations."""
        s = self.settings
        held = self.held_by(worker)
        systems = {c.system for c in held}
        return len(systems) * s.system_tokens // s.block_size + sum(
            c.history_tokens // s.block_size for c in held
        )

    def system_tokens(self, system: int) -> list[int]:
        return self.tokens(f"system:{system}", self.settings.system_tokens)

    def conversation_tokens(self, conv: Conversation) -> list[int]:
        """The conversation's cached prompt: its system prompt, then its history."""
        own = self.tokens(f"conversation:{conv.index}", conv.history_tokens)
        return self.system_tokens(conv.system) + own

    def tokens(self, name: str, n: int) -> list[int]:
        raw = array("H", random.Random(f"{self.settings.seed}:{name}").randbytes(2 * n))
        span = self.settings.vocab_size - FIRST_TOKEN
        return [FIRST_TOKEN + t % span for t in raw]


def _holders(rng: random.Random, among: list[int], extra: tuple[float, ...]) -> list[int]:
    """One worker of `among`, then one more with each probability of `extra` (while any is left)."""
    holders = [rng.choice(among)]
    for p in extra:
        if rng.random() < p and len(holders) < len(among):
            holders.append(rng.choice([w for w in among if w not in holders]))
    return holders


@dataclass(frozen=True)
class Probe:
    """One routed prompt and what the index should answer for it."""

    prompt: list[int]
    kind: (
        str  # "continue" (a cached conversation's next turn), "new" (cached system prompt), "cold"
    )
    # worker id -> leading blocks it caches of this prompt (holders of the longest prefix first)
    expected: dict[str, int]


def probes(plan: IndexPlan, count: int, seed: int = 1) -> list[Probe]:
    """`count` prompts of `prompt_tokens` each: 70% continue a cached conversation, 20% start a
    new one on a cached system prompt, 10% share nothing with the index."""
    s = plan.settings
    rng = random.Random(f"probes:{s.seed}:{seed}")
    by_system: dict[int, list[Conversation]] = {}
    for c in plan.conversations:
        by_system.setdefault(c.system, []).append(c)
    out = []
    for i in range(count):
        roll = rng.random()
        fresh = f"turn:{seed}:{i}"
        if roll < 0.7:
            conv = rng.choice(plan.conversations)
            cached = plan.conversation_tokens(conv)
            prompt = cached + plan.tokens(fresh, s.prompt_tokens - len(cached))
            out.append(Probe(prompt, "continue", expected_holders(plan, by_system, conv)))
        elif roll < 0.9:
            system = rng.choice(sorted(by_system))
            cached = plan.system_tokens(system)
            prompt = cached + plan.tokens(fresh, s.prompt_tokens - len(cached))
            out.append(Probe(prompt, "new", system_holders(plan, by_system[system])))
        else:
            out.append(Probe(plan.tokens(fresh, s.prompt_tokens), "cold", {}))
    return out


def system_holders(plan: IndexPlan, convs: list[Conversation]) -> dict[str, int]:
    blocks = plan.settings.system_tokens // plan.settings.block_size
    return {plan.worker_id(w): blocks for c in convs for w in c.holders}


def expected_holders(
    plan: IndexPlan, by_system: dict[int, list[Conversation]], conv: Conversation
) -> dict[str, int]:
    """Leading blocks each worker caches of `conv`'s next turn: its whole history on its
    holders, the system prompt on every other worker that caches that system prompt."""
    expected = system_holders(plan, by_system[conv.system])
    total = (plan.settings.system_tokens + conv.history_tokens) // plan.settings.block_size
    for w in conv.holders:
        expected[plan.worker_id(w)] = total
    return expected
