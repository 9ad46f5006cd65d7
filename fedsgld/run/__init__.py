"""The run around the maths, shared by both transports: lifecycle (resolve, resume, charge,
checkpoint, finish), the result directory and its report."""
