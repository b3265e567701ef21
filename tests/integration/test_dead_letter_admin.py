"""Dead letters in the admin: read-only evidence; replay and discard need their permission."""

from __future__ import annotations

import pytest
from django.contrib.auth.models import Permission, User
from django.test import Client
from django.utils import timezone

from django_outbox.models import Attempt, DeadLetter, DeadLetterReason, DeadLetterStatus, Outcome
from tests.support.waiting import wait_for
from tests.testapp.models import Counter

pytestmark = pytest.mark.django_db(transaction=True)

CHANGELIST = "/admin/django_outbox/deadletter/"


def staff(*perms: str) -> Client:
    user = User.objects.create_user(
        "op-" + "-".join(perms or ("none",)), password="pw", is_staff=True
    )
    user.user_permissions.add(*Permission.objects.filter(codename__in=["view_deadletter", *perms]))
    client = Client()
    client.force_login(user)
    return client


def letter(queue: str = "", **kw: object) -> DeadLetter:
    now = timezone.now()
    fields = dict(
        task_id=f"t-{DeadLetter.objects.count()}",
        task_name="tests.increment",
        kwargs={"name": "replayed", "op_id": "1"},
        args=[],
        idempotency_key="counter:replayed:op:1",
        reason=DeadLetterReason.PERMANENT,
        error_class="builtins.ValueError",
        error_message="boom",
        first_seen=now,
        last_attempt=now,
        queue=queue,
    )
    fields.update(kw)
    return DeadLetter.objects.create(**fields)


def act(client: Client, action: str, *letters: DeadLetter, confirm: bool = True):  # type: ignore[no-untyped-def]
    """Post an action as the confirmation page's button does (``post=yes``), or, with
    ``confirm=False``, as the list's "Go" button does (which shows that page)."""
    data = {"action": action, "_selected_action": [str(d.pk) for d in letters]}
    if confirm:
        data["post"] = "yes"
    return client.post(CHANGELIST, data, follow=True)


def test_dead_letters_are_read_only_evidence() -> None:
    d = letter()
    client = staff("change_deadletter", "delete_deadletter", "add_deadletter")
    page = client.get(f"{CHANGELIST}{d.pk}/change/")
    assert page.status_code == 200
    assert b'name="_save"' not in page.content
    assert client.get(f"{CHANGELIST}add/").status_code == 403
    assert client.post(f"{CHANGELIST}{d.pk}/delete/", {"post": "yes"}).status_code == 403
    assert DeadLetter.objects.filter(pk=d.pk).exists()


def test_replay_and_discard_are_not_offered_without_permission(redis_client) -> None:
    d = letter(queue="q-none")
    client = staff()
    page = client.get(CHANGELIST)
    assert b'value="replay"' not in page.content
    assert b'value="discard"' not in page.content
    act(client, "replay", d)
    act(client, "discard", d)
    d.refresh_from_db()
    assert d.status == DeadLetterStatus.OPEN
    assert redis_client.llen("q-none") == 0


def test_discard_closes_the_letter_and_keeps_it() -> None:
    d = letter()
    client = staff("discard_deadletter")
    assert b'value="replay"' not in client.get(CHANGELIST).content
    response = act(client, "discard", d)
    assert b"Discarded 1 dead letter" in response.content
    d.refresh_from_db()
    assert d.status == DeadLetterStatus.DISCARDED
    assert d.resolved_by.startswith("op-")


@pytest.mark.worker
def test_replay_republishes_with_the_same_key_and_links_the_attempt(start_worker, queue) -> None:
    Counter.objects.create(name="replayed")
    d = letter(queue=queue)
    start_worker()
    client = staff("replay_deadletter")
    response = act(client, "replay", d)
    assert b"Replayed 1 dead letter" in response.content
    d.refresh_from_db()
    assert d.status == DeadLetterStatus.REPLAYED
    attempt = wait_for(
        lambda: Attempt.objects.filter(task_id=d.replayed_task_id).first(),
        what="the replayed attempt",
    )
    assert attempt.outcome == Outcome.APPLIED
    assert attempt.idempotency_key == d.idempotency_key
    assert attempt.replay_of == d.pk
    assert Counter.objects.get(name="replayed").value == 1
    # A second replay of the same letter is refused: it is no longer open.
    act(client, "replay", d)
    assert Attempt.objects.count() == 1


def test_replay_and_discard_are_written_to_the_admin_history(redis_client, queue) -> None:
    from django.contrib.admin.models import LogEntry

    replayed, discarded = letter(queue=queue), letter()
    act(staff("replay_deadletter"), "replay", replayed)
    act(staff("discard_deadletter"), "discard", discarded)
    replayed.refresh_from_db()
    entries = {e.object_id: e for e in LogEntry.objects.all()}
    assert (
        f"Replayed as task {replayed.replayed_task_id}" in entries[str(replayed.pk)].change_message
    )
    assert entries[str(replayed.pk)].user.username == "op-replay_deadletter"
    assert "Discarded" in entries[str(discarded.pk)].change_message
    redis_client.delete(queue)


def test_a_refused_replay_says_why(redis_client, queue) -> None:
    conflict = letter(queue=queue, reason=DeadLetterReason.CONFLICT)
    closed = letter(queue=queue, status=DeadLetterStatus.DISCARDED)
    response = act(staff("replay_deadletter"), "replay", conflict, closed)
    page = response.content.decode()
    assert "is a conflict" in page and "can only fail again" in page
    assert "is discarded, not open: not replayed" in page
    assert "Replayed 0 dead letter(s)." in page
    conflict.refresh_from_db()
    assert conflict.status == DeadLetterStatus.OPEN  # refused: still open for a discard
    assert redis_client.llen(queue) == 0


def test_replay_and_discard_first_show_what_they_will_do(redis_client, queue) -> None:
    from django_outbox.models import ProcessedOperation

    ready = letter(queue=queue)
    conflict = letter(queue=queue, reason=DeadLetterReason.CONFLICT, idempotency_key="order:9")
    ProcessedOperation.objects.create(
        key="order:9",
        task_name="tests.increment",
        task_id="applied-task",
        fingerprint="f" * 64,
        processed_at=timezone.now(),
    )
    client = staff("replay_deadletter", "discard_deadletter")
    page = act(client, "replay", ready, conflict, confirm=False).content.decode()
    # Nothing happened yet: both letters still open, nothing published.
    for d in (ready, conflict):
        d.refresh_from_db()
        assert d.status == DeadLetterStatus.OPEN
    assert redis_client.llen(queue) == 0
    assert "are you sure?" in page
    assert f"queue &#x27;{queue}&#x27;" in page  # where the replay will go
    assert "Refused:" in page and "can only fail again" in page
    assert "by task applied-task" in page  # the applied row beside the new arguments
    assert "Yes, replay 1 dead letter(s)" in page
    assert 'name="post" value="yes"' in page

    # The page's button: one replayed, the conflict refused with its reason.
    done = act(client, "replay", ready, conflict).content.decode()
    assert "Replayed 1 dead letter(s)." in done
    ready.refresh_from_db()
    assert ready.status == DeadLetterStatus.REPLAYED
    assert redis_client.llen(queue) == 1

    # Nothing left that can be replayed: the page says so and offers no button.
    page = act(client, "replay", ready, confirm=False).content.decode()
    assert "nothing to do" in page and 'id="confirm"' not in page
    redis_client.delete(queue)


def test_the_letter_page_offers_its_actions_by_permission() -> None:
    d = letter()
    page = staff("replay_deadletter").get(f"{CHANGELIST}{d.pk}/change/").content.decode()
    assert 'id="replay-this"' in page and 'id="discard-this"' not in page
    page = staff().get(f"{CHANGELIST}{d.pk}/change/").content.decode()
    assert 'id="replay-this"' not in page and 'id="discard-this"' not in page
    d.status = DeadLetterStatus.DISCARDED
    d.save()
    page = staff("discard_deadletter").get(f"{CHANGELIST}{d.pk}/change/").content.decode()
    assert 'id="discard-this"' not in page  # closed: nothing to offer
