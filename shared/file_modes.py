"""The modes of files and folders the product writes for other processes to read (artifacts, the worker cache).

safetensors writes its files owner-only (0600) and tempfile.mkdtemp makes its folders 0700, whatever the umask:
they get the modes other files and folders of the process get instead, or a service running as another account
(workers sharing a cache, a worker reading a quantizer's output) cannot read them. The umask is read once, at
import (reading it means setting it, which is not safe while other threads create files)."""

from __future__ import annotations

import os

_UMASK = os.umask(0o022)
os.umask(_UMASK)

FILE_MODE = 0o666 & ~_UMASK
FOLDER_MODE = 0o777 & ~_UMASK
