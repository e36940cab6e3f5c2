"""The serve room: the leader's loop and its helpers (intake, claims, control, the writer, the
heartbeat, the batch runner, liveness, retention, start-up and reloads), and the followers' loop.

May import the group and forward rooms and the floors; nothing below imports it
(tests/unit/test_rooms.py).
"""
