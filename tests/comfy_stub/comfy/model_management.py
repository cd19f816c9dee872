"""Stand-in for ``comfy.model_management``: the interrupt flag."""
interrupt_processing = False


class InterruptProcessingException(Exception):
    pass


def interrupt_current_processing(value=True):
    global interrupt_processing
    interrupt_processing = value


def processing_interrupted():
    return interrupt_processing


def throw_exception_if_processing_interrupted():
    global interrupt_processing
    if interrupt_processing:
        interrupt_processing = False
        raise InterruptProcessingException()


def should_use_bf16(device=None):
    return False
