"""A training rank's wall time per phase (hybridtrain.time_split), on a clock the test moves."""

from __future__ import annotations

from hybridtrain.time_split import PhaseClock


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_phases_add_up_by_category_and_the_current_one_counts_up_to_now():
    clock = Clock()
    phases = PhaseClock("starting", clock)
    for phase, seconds in (("loading data", 3.0), ("rendezvous", 2.0), ("training", 1.5), ("training", 10.0),
                           ("checkpointing", 1.0), ("evaluating", 0.5), ("checkpointing", 4.0), ("training", 1.0)):
        clock.now += seconds  # time spent in the phase before this change
        phases.enter(phase)
    clock.now += 2.5
    assert phases.seconds() == {"startup": 3.0, "data_loading": 2.0, "rendezvous": 1.5,
                                "training_steps": 10.0 + 1.0 + 2.5, "checkpoint_writes": 0.5 + 1.0, "evaluation": 4.0}


def test_an_unknown_phase_is_reported_under_its_own_name():
    clock = Clock()
    phases = PhaseClock("starting", clock)
    clock.now += 1
    phases.enter("draining")
    clock.now += 2
    assert phases.seconds() == {"startup": 1.0, "draining": 2.0}
