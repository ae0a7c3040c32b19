"""The control-plane protocol: the one vocabulary the launcher, the agents and the workers share.

* :mod:`felactl.control.keys`: every store key of a job (names relative to its prefix).
* :mod:`felactl.control.documents`: the documents, as typed dataclasses.
* :mod:`felactl.control.seal`: their encoding and HMAC-SHA256 signing under the job secret,
  bound to the job (run and launch session), the key, the generation and a sequence number.
* :mod:`felactl.control.events`: the kinds of event a run records.
* :mod:`felactl.control.metrics`: the run's ``metrics.jsonl`` (workers write it, the launcher
  and ``felactl status`` summarize it).
* :mod:`felactl.control.stragglers`: the ``--slowdown`` and ``--straggler`` patterns, checked by
  the launcher and injected by the workers.

The store (torch's TCPStore) has no authentication: anyone who reaches it can read, write and
delete any key. The secret decides who may *make anyone act*, so every document that does is
signed, and whoever reads it verifies before acting; a forgery is ignored and recorded as a
``refused`` event (by whoever can: the coordinator for what it reads and for its own keys, a
worker for what workers read), and the job goes on.

Signed (the reader acts on them):

=================================  =============  ===================================================
key                                written by     read by, to
=================================  =============  ===================================================
``job``, ``job.<attempt>``         coordinator    agents: what to run
``stop``                           coordinator    agents: stop (or drain) the workers
``agents/<id>/commands`` (queue)   coordinator    an agent: start or kill a worker
``agents/<id>/state``              agent          coordinator: a worker failed, the job ended
``join/challenge/<id>/<nonce>``    coordinator    a joining agent: the nonce it must sign
``join/reply/<id>/<nonce>``        coordinator    a joining agent: admitted (and the launch's session)
``elastic/gen/<G>``                coordinator    workers: the members and plan of generation G
``elastic/scale/requests`` (queue) felactl scale  coordinator: rescale
``elastic/scale/reply/<id>``       coordinator    felactl scale: what happened
``elastic/done/<w>``               worker         coordinator: the job is finished
``elastic/hb/<w>``                 worker         coordinator: the worker lives (else it is dropped)
``elastic/ready/<w>``              worker         coordinator: a newcomer may join a generation
``elastic/switched/<G>/<w>``       worker         coordinator: a change is complete
``elastic/stuck/<G>/<w>``          worker         coordinator: re-form members that reach each other
``elastic/left/<G>/<w>``           worker         nobody acts on it (a record, signed for uniformity)
``elastic/arrived/<G>/<rank>``     worker         members of G: form the group; where to probe it
``elastic/switch/<G>``             workers        workers: the step to switch after (first wins)
``drain/last_step``                workers        workers: the graceful stop's last step (first wins)
=================================  =============  ===================================================

The join request queue (``join/requests``) carries proofs of the secret, not documents: a
hello, answered by a per-agent challenge (nobody can lock every agent out through one key),
and a join signed over that challenge.

Not signed, and why:

* ``elastic/generation``: a hint only (the newest generation's number), so a watcher need not
  list documents; a number without a valid ``elastic/gen/<G>`` is ignored by the workers, and the
  coordinator, which knows the true generation, writes it back within a poll when it was
  deleted or changed (``repaired`` event).
* ``felactl/job``: the job's name, a hint for an agent started without ``--job``; a wrong one
  makes the join fail, it cannot admit anyone.
* ``agents/<id>/beat``: an agent's liveness counter (``add``; a counter cannot carry a
  signature). It only labels why a worker went silent and refuses a scale-out to a node whose
  agent is silent; the workers' own signed heartbeats decide who is dropped.
* the data plane: ``data/next`` (the sample counter of workers at their own pace), the token
  bucket's ``tok/...`` counters and sums, SDPipe's (``sd/s<stage>/...``) and WBSP's arrival
  keys, the flexible pipeline's ``fx/...`` queues, the process groups' ``gen<G>/pg/...``
  rendezvous. They carry
  data and counters at training speed, like gloo's own traffic, which is unauthenticated too:
  someone who can write them can spoil training data just as one who can reach gloo's sockets
  can, and felactl does not claim to prevent it (run multi-node jobs on a trusted network).

How the secret travels: a file of mode 0600 in the 0700 run directory; to ssh agents on stdin;
from an agent to the felactl workers it starts in their environment (``FELACTL_SECRET``,
never to a user's ``--script``, never on the store). The launch's session (a random id that
makes documents of an earlier launch of the same run useless here) travels on the store: in
the signed join reply to agents, in the signed job document to workers, and in the run's
``launch`` event to ``felactl scale``.
"""

from felactl.control import keys
from felactl.control.documents import DocKind
from felactl.control.events import EventKind
from felactl.control.seal import Forged, Reader, Seal, job_binding

__all__ = ["DocKind", "EventKind", "Forged", "Reader", "Seal", "job_binding", "keys"]
