"""Contracts both sides of teacherq use: settings, messages, keys, codec, storage, logging."""
