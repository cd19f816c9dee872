"""Stand-in for ``comfy.utils``: ProgressBar that records its updates; set_attr for object patches."""
PROGRESS_BAR_HOOK = None
UPDATES = []


class ProgressBar:
    def __init__(self, total, node_id=None):
        self.total, self.current = total, 0

    def update_absolute(self, value, total=None, preview=None):
        if total is not None:
            self.total = total
        self.current = min(value, self.total)
        UPDATES.append((self.current, self.total))

    def update(self, value):
        self.update_absolute(self.current + value)


def set_attr(obj, attr, value):
    *parts, name = attr.split(".")
    for p in parts:
        obj = getattr(obj, p)
    prev = getattr(obj, name)
    setattr(obj, name, value)
    return prev
