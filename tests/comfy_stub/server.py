"""Stand-in for ``server.PromptServer``: records progress texts."""


class PromptServer:
    instance = None

    def __init__(self):
        self.texts = []

    def send_progress_text(self, text, node_id, sid=None):
        self.texts.append((node_id, text))


PromptServer.instance = PromptServer()
