"""The group room: what the ranks of one replica agree on and exchange (the group's agreement,
the leader-to-peers broadcast of batches and commands, fault injection points).

May import the forward room and the floors, never serve (tests/unit/test_rooms.py).
"""
