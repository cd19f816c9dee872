"""Stand-in for ``folder_paths``: one folder per kind, set by tests."""
import os

FOLDERS = {"text_encoders": None, "embeddings": None}


def get_filename_list(kind):
    folder = FOLDERS.get(kind)
    return sorted(os.listdir(folder)) if folder and os.path.isdir(folder) else []


def get_full_path_or_raise(kind, name):
    path = os.path.join(FOLDERS[kind] or "", name)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"Model in folder '{kind}' with filename '{name}' not found.")
    return path


def get_folder_paths(kind):
    return [FOLDERS[kind]] if FOLDERS.get(kind) else []


def get_full_path(kind, name):
    """As ComfyUI's: the path, or None when there is no such file."""
    path = os.path.join(FOLDERS.get(kind) or "", name)
    return path if os.path.isfile(path) else None
