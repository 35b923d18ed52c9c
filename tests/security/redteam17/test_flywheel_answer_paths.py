"""F7: a flywheel proposal's ``answer_files`` may name any absolute path, including the
hidden-tests root (``/opt/dsec-hidden``) and the verifier's own interpreter. The judge
copies those paths *from the solver's sandbox* into the judge sandbox, over the hidden
tests layer and the image: a solver that writes its own ``/opt/dsec-hidden/test.sh``
(``exit 0``) has it carried over the real one and earns 1.0. The proposer is a model (in
self-play the same policy as the solver), so the check belongs in the proposal's type."""

from __future__ import annotations

import pytest

from dsec.errors import InvalidArgument
from dsec.rl.flywheel import HIDDEN_ROOT, TaskProposal


@pytest.mark.parametrize("path", [f"{HIDDEN_ROOT}/test.sh", HIDDEN_ROOT + "/check/x",
                                  "/bin/sh", "/workspace/../opt/dsec-hidden/test.sh"])
def test_answer_files_cannot_overlay_the_hidden_tests_or_the_verifier(path: str) -> None:
    with pytest.raises(InvalidArgument):
        TaskProposal(id="t1", prompt="p", setup=[], tests={"test.sh": "exit 1\n"},
                     verify=["/bin/sh", "{hidden}/test.sh"], answer_files=[path])
